# OCI image layouts written with tar and sha256sum alone (no registry, no buildah): sourced by
# scripts/install-node (the test nodes' busybox images) and scripts/build-image (xpu's image,
# when buildah is not there). Every image of one layout shares its one uncompressed layer, made
# reproducibly (sorted names, owner 0, mtime 0), so its digest is also its diff id.
#
#   oci_init DIR              start a layout in DIR (created)
#   oci_layer ROOTFS          the layer every following image has
#   oci_image NAME CONFIG     add image NAME (a reference, e.g. localhost/xpu:0.1.0) whose
#                             image config's "config" object is the JSON CONFIG
#   oci_write FILE            the layout as a tar archive (`ctr images import` reads it)

oci_init() {
  oci_dir="$1"
  oci_manifests=""
  oci_arch=$(go env GOARCH 2>/dev/null || dpkg --print-architecture)
  mkdir -p "$oci_dir/blobs/sha256"
}

# Puts a file into the layout; prints "sha256:<hex> <size>".
oci_blob() {
  local digest size
  digest=$(sha256sum "$1" | cut -d' ' -f1)
  size=$(stat -c %s "$1")
  mv "$1" "$oci_dir/blobs/sha256/$digest"
  echo "sha256:$digest $size"
}

oci_layer() {
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$1" -cf "$oci_dir/layer" .
  read -r oci_layer_digest oci_layer_size < <(oci_blob "$oci_dir/layer")
}

oci_image() {
  local config config_size manifest manifest_size
  printf '{"architecture":"%s","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["%s"]}}' \
    "$oci_arch" "$2" "$oci_layer_digest" >"$oci_dir/config"
  read -r config config_size < <(oci_blob "$oci_dir/config")
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"%s","size":%s}]}' \
    "$config" "$config_size" "$oci_layer_digest" "$oci_layer_size" >"$oci_dir/manifest"
  read -r manifest manifest_size < <(oci_blob "$oci_dir/manifest")
  oci_manifests="$oci_manifests${oci_manifests:+,}$(printf '{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"%s","size":%s,"platform":{"architecture":"%s","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}' \
    "$manifest" "$manifest_size" "$oci_arch" "$1" "${1##*:}")"
}

oci_write() {
  printf '{"imageLayoutVersion":"1.0.0"}' >"$oci_dir/oci-layout"
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[%s]}' \
    "$oci_manifests" >"$oci_dir/index.json"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$oci_dir" -cf "$1.tmp" .
  mv "$1.tmp" "$1"
}
