#!/usr/bin/env bash
# Apply specgate's patches to an installed (or unpacked) SGLang 0.5.17 and byte-compile the
# files they touch. Fails when a patch does not apply cleanly, so a broken patch stops the build.
#   bash worker-image/apply-patch.sh SITE_PACKAGES_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
site=${1:?usage: apply-patch.sh SITE_PACKAGES_DIR (the folder that holds sglang/)}
test -f "$site/sglang/_version.py" || { echo "no sglang/ in $site" >&2; exit 2; }
version=$(python3 -c "import re,sys; print(re.search(r'__version__ = version = .([0-9.a-z+]+).', open(sys.argv[1]).read()).group(1))" "$site/sglang/_version.py")
if [ "$version" != "0.5.17" ]; then
  echo "apply-patch: the patches are for SGLang 0.5.17, found $version" >&2
  exit 2
fi
for patch in "$here"/patches/*.patch; do
  echo "applying $(basename "$patch")"
  (cd "$site" && patch -p1 --forward --batch --no-backup-if-mismatch --reject-file=- --quiet) < "$patch"
done
files=$(grep -h '^+++ b/' "$here"/patches/*.patch | sed 's#^+++ b/##' | sort -u)
(cd "$site" && python3 -m py_compile $files)
echo "patched and compiled: $(echo "$files" | wc -l) files"
