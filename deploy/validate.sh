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
  kubernetes-validate --strict --kubernetes-version "$v" "$rendered"
done
