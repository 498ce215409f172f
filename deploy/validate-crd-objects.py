#!/usr/bin/env python3
"""Validates objects of CRD kinds (which kubernetes-validate has no schema for) against the openAPIV3Schema of the
CRD kept in deploy/crds/, strictly: a field the schema does not declare is an error, as it would be pruned by the
API server. Usage: validate-crd-objects.py CRD_DIR FILE...; exits 1 on the first invalid object."""

import sys

import jsonschema
import yaml


def strict(schema):
    """The schema with undeclared fields refused wherever it lists properties."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def main():
    crd_dir, files = sys.argv[1], sys.argv[2:]
    import glob

    schemas = {}
    for path in glob.glob(f"{crd_dir}/*.yaml"):
        for crd in yaml.safe_load_all(open(path)):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for v in crd["spec"]["versions"]:
                if v.get("served"):
                    schemas[(f"{group}/{v['name']}", kind)] = strict(v["schema"]["openAPIV3Schema"])
    checked = 0
    for f in files:
        for obj in yaml.safe_load_all(open(f)):
            if not obj:
                continue
            key = (obj.get("apiVersion"), obj.get("kind"))
            if key not in schemas:
                print(f"{f}: no CRD schema in {crd_dir} for {key[1]} {key[0]}", file=sys.stderr)
                sys.exit(1)
            try:
                jsonschema.validate(obj, schemas[key])
            except jsonschema.ValidationError as e:
                print(f"{f}: {key[1]} {obj.get('metadata', {}).get('name')} failed validation: {e.message} "
                      f"at {'/'.join(map(str, e.absolute_path))}", file=sys.stderr)
                sys.exit(1)
            checked += 1
    print(f"CRD objects: {checked} valid against {crd_dir}")


if __name__ == "__main__":
    main()
