import json
import sys

print(json.dumps({"argv": sys.argv, "name": __name__, "spec": __spec__.name, "package": __package__}))
