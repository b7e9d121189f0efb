#!/usr/bin/env bash
# make-rootfs.sh BUSYBOX ROOTFS_DIR OUT: a busybox initramfs (cpio, gzip) and an ext4 root image
# with the same content, built without root privileges or loop mounts (mkfs.ext4 -d).
set -euo pipefail
busybox="$1"; rdir="$2"; out="$3"
stage="$out/rootfs-stage"
rm -rf "$stage"
mkdir -p "$stage"/{bin,sbin,etc,proc,sys,dev,tmp,root,mnt,usr/bin,usr/sbin}
cp "$busybox" "$stage/bin/busybox"
for app in $("$busybox" --list); do
    [ "$app" = busybox ] || ln -sf /bin/busybox "$stage/bin/$app"
done
install -m 0755 "$rdir/init" "$stage/init"
ln -sf /init "$stage/sbin/init"
echo "microvirt" > "$stage/etc/hostname"
(cd "$stage" && find . -print0 | cpio --null -o -H newc --quiet | gzip -9) > "$out/initramfs.cpio.gz"
truncate -s 64M "$out/rootfs.ext4"
mkfs.ext4 -q -F -L microvirt-root -d "$stage" "$out/rootfs.ext4"
rm -rf "$stage"
