#!/usr/bin/env bash
# build-linux.sh SRC_TAR LINUX_DIR PROFILE OUT: builds vmlinux from Debian's linux-source tarball
# with microvirt's config (and, for a non-production profile, its config fragment and patches).
set -euo pipefail
src_tar="$1"; ldir="$2"; profile="$3"; out="$4"
work="$out/build"
mkdir -p "$work"
tar -xf "$src_tar" -C "$work" --strip-components=1
cd "$work"
if [ "$profile" != production ]; then
    for p in "$ldir"/patches/"$profile"/*.patch; do
        [ -e "$p" ] || continue
        patch -p1 --quiet < "$p"
    done
fi
# Start from tinyconfig and enable exactly what a microvirt guest needs.
make -s tinyconfig
scripts/kconfig/merge_config.sh -m -O . .config "$ldir/config" >/dev/null
if [ "$profile" != production ]; then
    scripts/kconfig/merge_config.sh -m -O . .config "$ldir/profiles/$profile.config" >/dev/null
fi
make -s olddefconfig
# Fail if a requested option did not stick (a typo or a missing dependency).
missing=0
for f in "$ldir/config" $( [ "$profile" = production ] || echo "$ldir/profiles/$profile.config" ); do
    while IFS= read -r line; do
        case "$line" in
            CONFIG_*=y) grep -qx "$line" .config || { echo "config: $line did not stick" >&2; missing=1; } ;;
            "# CONFIG_"*" is not set") opt="${line#\# }"; opt="${opt%% *}"; grep -q "^$opt=y" .config && { echo "config: $opt is still set" >&2; missing=1; } ;;
        esac
    done < "$f"
done
[ "$missing" = 0 ] || exit 1
make -s -j"$(nproc)" vmlinux
cp vmlinux "$out/vmlinux"
cp .config "$out/config"
cd "$out"
rm -rf "$work"
