#!/usr/bin/env bash
# packaging/deb/build.sh [OUTDIR]: the one command that builds Berth's installable artefacts from a checkout on
# Debian 12: the sdist and the wheel (`python -m build`, checked with `twine check --strict`) in OUTDIR, and the
# Debian packages berth, berth-agent and berth-controlplane (dpkg-buildpackage on packaging/deb/debian) in
# OUTDIR/deb. OUTDIR defaults to dist/ in the checkout. It downloads (through pip, from the configured index)
# the build tools and the wheels of Berth's dependencies, and nothing else; the packages install offline.
#
# Environment:
#   BERTH_WORK_DIR         where to build (kept, and its tool environment reused); default: a temporary
#                          directory, removed at the end
#   BERTH_VERSION_LOCAL    a PEP 440 local label appended to pyproject.toml's version in the build's copy of
#                          the tree (0.1.0 -> 0.1.0+LABEL, Debian 0.1.0+LABEL), for test and upgrade builds;
#                          the checkout is never changed
#   BERTH_DEB_COMPRESSION  dpkg-deb compressor[:level]: xz (the default, level 6: smallest, about half a minute
#                          here), xz:1 (seconds; what tests/packaging uses) or gzip; not zstd, which lintian on
#                          Debian 12 rejects
#   SOURCE_DATE_EPOCH      the date of the Debian changelog entry (default: the last commit's, else now)
#   PIP_*                  pip's own settings (index, proxy, certificates, PIP_CONSTRAINT to pin the bundle)
set -euo pipefail

say() { printf 'build.sh: [%3ds] %s\n' "$SECONDS" "$*"; }
die() { printf 'build.sh: error: %s\n' "$*" >&2; exit 1; }
trap 'printf "build.sh: error: line %s failed: %s\n" "$LINENO" "$BASH_COMMAND" >&2' ERR

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${1:-$repo/dist}
mkdir -p "$out"
out=$(cd "$out" && pwd)
python=/usr/bin/python3

# -- tools -------------------------------------------------------------------------------------------------
missing=()
[ -x "$python" ] || missing+=(python3)
"$python" -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
ls /usr/share/python-wheels/pip-*.whl >/dev/null 2>&1 || missing+=(python3-pip-whl)
command -v dpkg-buildpackage >/dev/null || missing+=(dpkg-dev)
command -v dh >/dev/null || missing+=(debhelper)
if [ ${#missing[@]} -gt 0 ]; then
    die "missing build tools; install them with: apt-get install -y ${missing[*]}"
fi
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "$python is older than 3.11 (Berth needs 3.11+)"

if [ -n "${BERTH_WORK_DIR:-}" ]; then
    work=$BERTH_WORK_DIR
    mkdir -p "$work"
    work=$(cd "$work" && pwd)
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/berth-build.XXXXXX")
    trap 'rm -rf "$work"' EXIT
fi
say "building in $work; artefacts go to $out"

# -- 1. a clean copy of the tree ---------------------------------------------------------------------------
# Only what the checkout tracks or would track (git's own ignore rules), as it is on disk; without git, the
# tree minus the usual build and cache litter.
src=$work/src
rm -rf "$src"
mkdir -p "$src"
say "copying the tree from $repo"
if command -v git >/dev/null && git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard) |
        (cd "$repo" && while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done) |
        tar -C "$repo" --null -T - -cf - | tar -C "$src" -xf -
else
    tar -C "$repo" --exclude=.git --exclude=__pycache__ --exclude='*.egg-info' --exclude=build --exclude=dist \
        --exclude=.venv --exclude=.pytest_cache --exclude=.hypothesis -cf - . | tar -C "$src" -xf -
fi

version=$("$python" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
    "$src/pyproject.toml")
if [ -n "${BERTH_VERSION_LOCAL:-}" ]; then
    [[ $BERTH_VERSION_LOCAL =~ ^[A-Za-z0-9]+([.][A-Za-z0-9]+)*$ ]] ||
        die "BERTH_VERSION_LOCAL=$BERTH_VERSION_LOCAL is not a PEP 440 local label (letters, digits, dots)"
    [[ $version != *+* ]] || die "pyproject.toml's version $version already has a local label"
    sed -i "0,/^version = \"$version\"/s//version = \"$version+$BERTH_VERSION_LOCAL\"/" "$src/pyproject.toml"
    version=$version+$BERTH_VERSION_LOCAL
fi
say "version $version (from pyproject.toml${BERTH_VERSION_LOCAL:+, with the local label $BERTH_VERSION_LOCAL})"

# -- 2. build tools ----------------------------------------------------------------------------------------
tools=$work/tools
if [ ! -x "$tools/bin/twine" ] || [ ! -x "$tools/bin/pyproject-build" ]; then
    say "installing pip, build and twine into $tools"
    rm -rf "$tools"
    "$python" -m venv "$tools"
    # A current pip: Debian 12's (23.0) builds an sdist-only dependency such as cgroupspy with the legacy
    # `setup.py bdist_wheel`, which fails without the wheel package; a current one always builds in isolation.
    "$tools/bin/pip" install --quiet --disable-pip-version-check --upgrade pip &&
        "$tools/bin/pip" install --quiet --disable-pip-version-check build twine ||
        die "pip could not install pip, build and twine (is PyPI or your index reachable?)"
fi

# -- 3. sdist and wheel ------------------------------------------------------------------------------------
say "building the sdist and the wheel (python -m build)"
rm -f "$out"/berth-*.tar.gz "$out"/berth-*.whl
"$tools/bin/python" -m build --outdir "$out" "$src" >"$work/build.log" 2>&1 ||
    { tail -n 40 "$work/build.log" >&2; die "python -m build failed (log: $work/build.log)"; }
sdist=$(ls "$out"/berth-*.tar.gz)
wheel=$(ls "$out"/berth-*-py3-none-any.whl)
say "twine check --strict"
"$tools/bin/twine" check --strict "$sdist" "$wheel"

# -- 4. the dependencies' wheels ---------------------------------------------------------------------------
wheels=$work/wheels
rm -rf "$wheels"
say "downloading the wheels Berth depends on (pip wheel)"
"$tools/bin/pip" wheel --quiet --disable-pip-version-check --wheel-dir "$wheels" "$wheel" ||
    die "pip could not get the dependencies' wheels"
say "$(ls "$wheels" | wc -l) wheels"

# -- 5. the Debian packages --------------------------------------------------------------------------------
# PEP 440 -> Debian: pre-releases and dev releases sort before the release (~), post releases and local
# labels after it.
debversion=$("$tools/bin/python" - "$version" <<'EOF'
import sys
from packaging.version import Version

v = Version(sys.argv[1])
s = ".".join(map(str, v.release))
if v.pre:
    s += "~" + v.pre[0] + str(v.pre[1])
if v.post is not None:
    s += ".post" + str(v.post)
if v.dev is not None:
    s += "~dev" + str(v.dev)
if v.local:
    s += "+" + v.local
print(s)
EOF
)
if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
    SOURCE_DATE_EPOCH=$(git -C "$repo" log -1 --format=%ct 2>/dev/null || date +%s)
fi
export SOURCE_DATE_EPOCH
commit=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(GIT_OPTIONAL_LOCKS=0 git -C "$repo" status --porcelain 2>/dev/null | head -n 1 || true)
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-unstable}")

pkg=$work/deb/berth-$debversion
rm -rf "$work/deb"
mkdir -p "$pkg"
say "staging the Debian source berth $debversion in $pkg"
cp -a "$here/debian" "$pkg/debian"
cp -a "$here/conf" "$pkg/conf"
mv "$wheels" "$pkg/wheels"
mkdir -p "$pkg/examples" "$pkg/docs"
cp "$src/examples/bootstrap.json" "$src/examples/policies.cedar" "$src/examples/sshd-berth.conf" \
  "$src/examples/haproxy.cfg" "$pkg/examples/"
cp "$src/README.md" "$pkg/"
cp "$src/docs/operations.md" "$src/docs/agent.md" "$src/docs/scale-out.md" "$pkg/docs/"
# The units, exactly as systemd/ has them (ExecStart=/usr/bin/berth is the berth package's symlink to
# /opt/berth/bin/berth), where dh_installsystemd looks for them.
cp "$src/systemd/berth-agent.service" "$pkg/debian/berth-agent.service"
cp "$src/systemd/berth-controlplane.service" "$pkg/debian/berth-controlplane.service"
cat >"$pkg/debian/changelog" <<EOF
berth ($debversion) $codename; urgency=medium

  * Built from the Berth tree at commit $commit${dirty:+ with local changes}.
  * pyproject.toml version $version.

 -- Berth maintainers <berth-maintainers@example.net>  $(date -u -R -d "@$SOURCE_DATE_EPOCH")
EOF

say "dpkg-buildpackage -b (compression ${BERTH_DEB_COMPRESSION:-xz})"
(cd "$pkg" && BERTH_DEB_COMPRESSION=${BERTH_DEB_COMPRESSION:-xz} dpkg-buildpackage -b -us -uc) \
    >"$work/dpkg-buildpackage.log" 2>&1 ||
    { tail -n 60 "$work/dpkg-buildpackage.log" >&2; die "dpkg-buildpackage failed (log: $work/dpkg-buildpackage.log)"; }
grep '^make-venv: ' "$work/dpkg-buildpackage.log" | sed 's/^/build.sh: /' || true

mkdir -p "$out/deb"
rm -f "$out"/deb/berth*_*.deb "$out"/deb/berth_*.changes "$out"/deb/berth_*.buildinfo
mv "$work"/deb/berth*_"$debversion"_*.deb "$work"/deb/berth_"$debversion"_*.changes \
    "$work"/deb/berth_"$debversion"_*.buildinfo "$out/deb/"
say "done:"
for f in "$sdist" "$wheel" "$out"/deb/*; do
    printf '  %s  (%s)\n' "$f" "$(du -h "$f" | cut -f1)"
done
