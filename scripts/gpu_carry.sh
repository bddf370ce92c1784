#!/usr/bin/env bash
# Split a file too large for one device call (model weights: a GGUF file) into pieces, one folder each,
# so that each call carries one folder: .gpu/p01 .. .gpu/pNN (git-ignored through /.gpu/).
#   here:    bash scripts/gpu_carry.sh FILE [MIB]          (MIB per piece, default 50: a call carries at
#                                                           most 64 MiB with the working tree)
#   device:  run(command="mkdir -p /tmp/carry && cp .gpu/pNN/* /tmp/carry/", carry=[".gpu/pNN"]), for each N,
#            calls back to back (the machine stays warm ~30 s), then
#            cat /tmp/carry/piece.* > /tmp/FILE && sha256sum -c /tmp/carry/SHA256SUM
set -euo pipefail
file=$1; mib=${2:-50}
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu/p[0-9]* && tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
split -b "${mib}M" -d -a 2 "$file" "$tmp/piece."
sum=$(sha256sum "$file" | cut -d' ' -f1)
i=0
for piece in "$tmp"/piece.*; do
  i=$((i + 1)); dir=$(printf '.gpu/p%02d' "$i"); mkdir -p "$dir"; mv "$piece" "$dir/"
done
echo "$sum  /tmp/$(basename "$file")" > .gpu/p01/SHA256SUM
echo "$i pieces of ${mib} MiB in .gpu/p01 .. $(printf '.gpu/p%02d' "$i"); sha256 $sum"
