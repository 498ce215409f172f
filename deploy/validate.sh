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

# Every sidecar image the manifests use is listed, with the same version, in csi-sidecar-images.txt.
for image in $(grep -oE 'registry\.k8s\.io/[^ "]+' "$rendered" | sort -u); do
  if ! grep -q "^$image " "$deploy_dir/csi-sidecar-images.txt"; then
    echo "failed validation: $image is not listed in csi-sidecar-images.txt" >&2
    exit 1
  fi
done
echo "sidecar images: every registry.k8s.io image is listed in csi-sidecar-images.txt"
