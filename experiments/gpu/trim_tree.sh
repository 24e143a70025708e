#!/usr/bin/env bash
# Here: take the tracked files over 60 kB under assets/, notebooks/, examples/ and experiments/results/
# out of the working tree so a GPU call's tree stays far under its 64 MiB (`min`; what remains is
# ~4 MB), and put back exactly the tracked files that are missing (`restore`; run it after the calls,
# before committing, since results copied in meanwhile are kept). A head's JSON config stays (the
# DFlash drafter's is ~90 kB; its weights travel in .gpucarry). Prints the size of what travels.
set -e
cd "$(git rev-parse --show-toplevel)"
case "${1:?usage: trim_tree.sh min|restore}" in
  min)
    git ls-files -z assets notebooks examples experiments/results | xargs -0 du -b 2>/dev/null \
      | awk '$1 > 60000 && $2 !~ /^assets\/.*\.json$/ {print $2}' | xargs -r rm -f
    ;;
  restore)
    git ls-files -d -z | xargs -0 -r git checkout --
    ;;
  *) echo "usage: trim_tree.sh min|restore" >&2; exit 2;;
esac
{ git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 du -cb 2>/dev/null | tail -1
