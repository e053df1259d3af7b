"""Validates a Compose file against the Compose specification's JSON schema.

Usage: compose_schema.py SCHEMA COMPOSE_FILE. Prints each violation with its path; exits 1 if
there is any. The schema is the one the `docker-compose` package ships (.ci/run extracts it).
"""
import json
import sys

import jsonschema
import yaml

with open(sys.argv[1], encoding="utf-8") as f:
    schema = json.load(f)
with open(sys.argv[2], encoding="utf-8") as f:
    document = yaml.safe_load(f)
validator = jsonschema.validators.validator_for(schema)(schema)
errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
for error in errors:
    path = "/".join(str(p) for p in error.absolute_path) or "(top level)"
    print(f"{sys.argv[2]}: {path}: {error.message}")
if errors:
    sys.exit(1)
print(f"{sys.argv[2]}: valid against {sys.argv[1]}")
