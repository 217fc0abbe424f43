#!/usr/bin/env bash
# Unpacks the Debian packages of the gRPC services (scripts/device_deps.sh keeps them in
# .deps/services-debs) into ROOT once (again when the set of packages changes), and prints ROOT. A -dev package's libFOO.so link whose
# runtime library is not carried (OpenSSL, zlib, libcurl: the GPU machines have their own) is
# pointed at this machine's libFOO.so.N. Usage: device_services_root.sh DEBS_DIR ROOT
set -euo pipefail
debs="$1"
root="$2"
packages="$(cd "$debs" && ls -- *.deb 2>/dev/null | sort | tr '\n' ' ')"
if [[ "$(cat "$root/.done" 2>/dev/null)" != "$packages" ]]; then
  compgen -G "$debs/*.deb" >/dev/null || {
    echo "device_services_root.sh: no .deb files in $debs (run scripts/device_deps.sh)" >&2
    exit 1
  }
  rm -rf "$root"
  mkdir -p "$root"
  for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$root"; done
  while IFS= read -r link; do
    target="$(basename "$(readlink "$link")")"  # libz.so.1.2.13
    soname="$(sed -E 's/^(.*\.so\.[0-9]+).*/\1/' <<<"$target")"  # libz.so.1
    for dir in /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu; do
      if [[ -e "$dir/$soname" ]]; then
        ln -sfn "$dir/$soname" "$link"
        break
      fi
    done
  done < <(find "$root" -xtype l -name '*.so')
  echo "$packages" >"$root/.done"
fi
echo "$root"
