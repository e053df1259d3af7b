"""Prints the YAML documents of a file as one JSON array (the Rust tests have no YAML parser)."""
import json
import sys

import yaml

with open(sys.argv[1], encoding="utf-8") as f:
    print(json.dumps([doc for doc in yaml.safe_load_all(f) if doc is not None]))
