#!/usr/bin/env bash
# The formatting check: every C++/CUDA source of the tree is as clang-format (the tree's
# .clang-format) writes it.
#   scripts/check_format.sh          check (exit 1 listing the files that differ)
#   scripts/check_format.sh --fix    rewrite them in place
# Run in CI by ctest (`format_check`, label lint). The style's output differs between clang-format
# major versions; the tree is kept formatted with the one Debian 12 ships (14), so with another
# major version, or none, the check is skipped (exit 77, the test's SKIP_RETURN_CODE) with a
# reason. PDSIM_CLANG_FORMAT names the binary (default: clang-format).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
pinned_major=14
clang_format="${PDSIM_CLANG_FORMAT:-clang-format}"
mode=check
case "${1:-}" in
  "") ;;
  --fix) mode=fix ;;
  *) echo "check_format.sh: unknown argument '$1' (expected --fix or nothing)" >&2; exit 2 ;;
esac
if ! command -v "$clang_format" >/dev/null 2>&1; then
  echo "check_format.sh: SKIP: $clang_format not found (install clang-format $pinned_major)"
  exit 77
fi
version=$("$clang_format" --version)
major=$(sed -nE 's/.*version ([0-9]+)\..*/\1/p' <<<"$version")
if [ "$major" != "$pinned_major" ]; then
  echo "check_format.sh: SKIP: $version; the tree is formatted with clang-format $pinned_major"
  exit 77
fi
cd "$root"
# The tree's sources: git's list in a clone, else every source under the project's folders.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- '*.h' '*.hpp' '*.cpp' '*.cc' '*.cu' '*.cuh' | \
                       grep -v '^tests/data/')
else
  mapfile -t files < <(find common topology backends transfer sim bench tests -type f \
                       \( -name '*.h' -o -name '*.hpp' -o -name '*.cpp' -o -name '*.cc' \
                          -o -name '*.cu' -o -name '*.cuh' \) -not -path 'tests/data/*' | sort)
fi
if [ "$mode" = fix ]; then
  printf '%s\0' "${files[@]}" | xargs -0 -P "$(nproc)" -n 16 "$clang_format" -i
  echo "check_format.sh: formatted ${#files[@]} files"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  [ -f "$f" ] || continue
  "$clang_format" --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ "${#bad[@]}" -gt 0 ]; then
  printf '%s: not as clang-format writes it\n' "${bad[@]}"
  echo "check_format.sh: ${#bad[@]} of ${#files[@]} files differ; see the changes with"
  echo "  clang-format --dry-run <file>; fix them all with scripts/check_format.sh --fix"
  exit 1
fi
echo "check_format.sh: ${#files[@]} files, all formatted ($version)"
