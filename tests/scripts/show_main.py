"""Prints what a script can observe about how it was started, as JSON."""

import json
import os
import sys

print(
    json.dumps(
        {
            "argv": sys.argv,
            "path0": sys.path[0],
            "name": __name__,
            "file": __file__,
            "spec": getattr(__spec__, "name", None),
            "package": __package__,
            "main_is_module": sys.modules["__main__"].__dict__ is globals(),
            "torch_loaded": "torch" in sys.modules,
            "autogaudi_env": os.environ.get("AUTOGAUDI"),
        }
    )
)
if __name__ == "__main__":
    code = os.environ.get("SHOW_MAIN_EXIT")
    if code:
        sys.exit(int(code))
