import json
import sys

print(
    json.dumps(
        {
            "argv": sys.argv,
            "path0": sys.path[0],
            "name": __name__,
            "file": __file__,
            "spec": __spec__.name,
            "package": __package__,
        }
    )
)
if len(sys.argv) > 1 and sys.argv[1] == "fail":
    raise KeyError("module failure")
