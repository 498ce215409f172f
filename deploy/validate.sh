#!/usr/bin/env bash
# Offline checks of the Kubernetes manifests: `kubectl kustomize` renders them, and every rendered object passes
# schema validation (kubernetes-validate, strict: unknown fields are errors) for the Kubernetes versions given
# (default: 1.29 and the validator's newest). Installs kubectl (Debian) and kubernetes-validate
# (PyPI) when missing. No cluster is needed or contacted.
#
#   deploy/validate.sh [K8S_VERSION...]
set -euo pipefail
deploy_dir=$(cd "$(dirname "$0")" && pwd)

if ! command -v kubectl >/dev/null; then
  # Debian's kubectl is in kubernetes-client. The manifests avoid kustomize features newer than its embedded
  # kustomize (e.g. `labels:`), so that one renders them too.
  echo "installing kubectl (Debian package kubernetes-client)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client >/dev/null
fi
if ! command -v kubernetes-validate >/dev/null; then
  echo "installing kubernetes-validate (PyPI)" >&2
  python3 -m pip install --quiet kubernetes-validate
fi

rendered=$(mktemp --suffix=.yaml)
trap 'rm -f "$rendered"' EXIT
kubectl kustomize "$deploy_dir" >"$rendered"
echo "kubectl kustomize: $(grep -c '^kind:' "$rendered") objects rendered"

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(1.29.0 "$(kubernetes-validate --version)")
for v in "${versions[@]}"; do
  out=$(kubernetes-validate --strict --kubernetes-version "$v" "$rendered" 2>&1) || { echo "$out"; exit 1; }
  echo "$out"
  # A kind without a schema is only a warning there: here it is an error (CRD kinds are checked below).
  if grep -q "Couldn't find schema" <<<"$out"; then
    echo "failed validation: a rendered object has no schema" >&2
    exit 1
  fi
done

# Objects of CRD kinds (applied outside the kustomization, after their CRDs): against the CRD schemas in crds/.
python3 "$deploy_dir/validate-crd-objects.py" "$deploy_dir/crds" "$deploy_dir/csi-snapshotclass.yaml"

# Every image is built by docker/build.sh (a docker/<image>/Dockerfile) or listed, with the same version, in
# external-images.txt.
docker_dir=$deploy_dir/../docker
for image in $(sed -n 's/^ *image: *//p' "$rendered" | tr -d '"' | sort -u); do
  name=${image%:*}
  if [ -f "$docker_dir/$name/Dockerfile" ]; then continue; fi
  if ! grep -q "^$image " "$deploy_dir/external-images.txt"; then
    echo "failed validation: $image is neither built by docker/build.sh (no docker/$name/Dockerfile)" \
      "nor listed in external-images.txt" >&2
    exit 1
  fi
done
echo "images: every image is built by docker/build.sh or listed in external-images.txt"

# Every RBAC rule says which component uses it: a comment on the line before each rule.
for f in "$deploy_dir"/*.yaml; do
  unannotated=$(awk '/^ *- apiGroups:/ && prev !~ /^ *#/ { print FILENAME ":" FNR } { prev = $0 }' "$f")
  if [ -n "$unannotated" ]; then
    echo "failed validation: RBAC rules without a comment naming the component that uses them:" >&2
    echo "$unannotated" >&2
    exit 1
  fi
done
echo "rbac: every rule names the component that uses it"
