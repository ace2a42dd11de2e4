package main

import (
	"archive/tar"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// The image formats --format writes.
const (
	formatDocker = "docker" // docker-archive: manifest.json, the config and layers by digest
	formatOCI    = "oci"    // an OCI image layout in a tar (oci-archive)
)

// ociLayoutFile is the layout's marker file (image-spec, image-layout.md).
const ociLayoutFile = `{"imageLayoutVersion":"1.0.0"}`

// Where the index names the image: containerd (and Docker 25+, which loads
// OCI layouts) reads the full reference from the first, the OCI spec and
// podman the tag from the second.
const (
	annotationContainerdName = "io.containerd.image.name"
	annotationRefName        = "org.opencontainers.image.ref.name"
)

// ociArchive writes img tagged tag as an OCI image layout
// (https://github.com/opencontainers/image-spec/blob/main/image-layout.md)
// in a tar: oci-layout, index.json naming the one manifest, and every blob
// (manifest, config, layers) under blobs/sha256/<hex>. `podman load`,
// `docker load` (Docker 25 and later), skopeo's oci-archive: and
// `tar -x` followed by any OCI tool read it. Entries are in a fixed order
// with fixed headers (mtime created, owner 0), so the same image gives the
// same bytes.
func ociArchive(w io.Writer, tag name.Tag, img v1.Image, created time.Time) error {
	manifest, err := img.RawManifest()
	if err != nil {
		return err
	}
	mdigest, err := img.Digest()
	if err != nil {
		return err
	}
	mt, err := img.MediaType()
	if err != nil {
		return err
	}
	cfg, err := img.RawConfigFile()
	if err != nil {
		return err
	}
	cdigest, err := img.ConfigName()
	if err != nil {
		return err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	index := v1.IndexManifest{
		SchemaVersion: 2,
		MediaType:     types.OCIImageIndex,
		Manifests: []v1.Descriptor{{
			MediaType: mt,
			Digest:    mdigest,
			Size:      int64(len(manifest)),
			Platform:  &v1.Platform{OS: cf.OS, Architecture: cf.Architecture},
			Annotations: map[string]string{
				annotationContainerdName: tag.String(),
				annotationRefName:        tag.TagStr(),
			},
		}},
	}
	indexJSON, err := json.Marshal(index)
	if err != nil {
		return err
	}

	type blob struct {
		digest v1.Hash
		body   []byte
	}
	blobs := []blob{{mdigest, manifest}, {cdigest, cfg}}
	layers, err := img.Layers()
	if err != nil {
		return err
	}
	for _, l := range layers {
		d, err := l.Digest()
		if err != nil {
			return err
		}
		rc, err := l.Compressed()
		if err != nil {
			return err
		}
		body, err := io.ReadAll(rc)
		_ = rc.Close()
		if err != nil {
			return err
		}
		blobs = append(blobs, blob{d, body})
	}

	tw := tar.NewWriter(w)
	put := func(name string, mode int64, body []byte) error {
		h := tar.Header{Name: name, Mode: mode, ModTime: created, Format: tar.FormatUSTAR, Typeflag: tar.TypeReg, Size: int64(len(body))}
		if body == nil {
			h.Typeflag, h.Size = tar.TypeDir, 0
		}
		if err := tw.WriteHeader(&h); err != nil {
			return fmt.Errorf("oci layout: %s: %w", name, err)
		}
		_, err := tw.Write(body)
		return err
	}
	for _, e := range []struct {
		name string
		body []byte
	}{
		{"oci-layout", []byte(ociLayoutFile)},
		{"index.json", indexJSON},
		{"blobs/", nil},
		{"blobs/sha256/", nil},
	} {
		mode := int64(0o644)
		if e.body == nil {
			mode = 0o755
		}
		if err := put(e.name, mode, e.body); err != nil {
			return err
		}
	}
	for _, b := range blobs {
		if b.digest.Algorithm != "sha256" {
			return fmt.Errorf("oci layout: blob %s is not sha256", b.digest)
		}
		if err := put("blobs/sha256/"+b.digest.Hex, 0o644, b.body); err != nil {
			return err
		}
	}
	return tw.Close()
}
