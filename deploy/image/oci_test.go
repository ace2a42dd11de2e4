package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// readOCI reads an OCI layout tarball: every entry's body by name, in the
// order written. Each entry must be a plain file or directory owned by 0:0
// with mtime testEpoch.
func readOCI(t *testing.T, path string) (map[string][]byte, []string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	files := map[string][]byte{}
	var order []string
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("oci tar: %v", err)
		}
		if h.Uid != 0 || h.Gid != 0 || !h.ModTime.Equal(time.Unix(testEpoch, 0)) ||
			(h.Typeflag != tar.TypeReg && h.Typeflag != tar.TypeDir) {
			t.Errorf("%s: type %c uid %d gid %d mtime %v, want a file or directory of 0:0 at SOURCE_DATE_EPOCH",
				h.Name, h.Typeflag, h.Uid, h.Gid, h.ModTime)
		}
		order = append(order, h.Name)
		if h.Typeflag == tar.TypeReg {
			if files[h.Name], err = io.ReadAll(tr); err != nil {
				t.Fatal(err)
			}
		}
	}
	return files, order
}

// TestImageOCI: --format oci writes an OCI image layout (oci-layout,
// index.json, blobs/sha256/<hex>) holding the same image as the default
// docker-archive: the same manifest digest, Cmd, ports and user. Every
// blob's name is its digest, and every descriptor's digest and size match
// the blob it names.
func TestImageOCI(t *testing.T) {
	needArch(t)
	oci := runImage(t, testEpoch, "--version", "dev", "--format", "oci")
	docker := runImage(t, testEpoch, "--version", "dev")
	if oci.digest != docker.digest || oci.id != docker.id {
		t.Errorf("oci layout holds %s (config %s), the docker-archive %s (config %s): want the same image",
			oci.digest, oci.id, docker.digest, docker.id)
	}
	if !strings.Contains(oci.stdout, "  format   oci\n") {
		t.Errorf("stdout does not say the format:\n%s", oci.stdout)
	}
	files, order := readOCI(t, oci.path)

	if got := string(files["oci-layout"]); got != `{"imageLayoutVersion":"1.0.0"}` {
		t.Errorf("oci-layout %q", got)
	}
	if len(order) < 2 || order[0] != "oci-layout" || order[1] != "index.json" {
		t.Errorf("entries %q: want oci-layout and index.json first", order)
	}
	for name, body := range files {
		hexd, ok := strings.CutPrefix(name, "blobs/sha256/")
		if !ok {
			if name != "oci-layout" && name != "index.json" {
				t.Errorf("unexpected file %s in the layout", name)
			}
			continue
		}
		if sum := sha256.Sum256(body); hex.EncodeToString(sum[:]) != hexd {
			t.Errorf("%s: its sha256 is %x", name, sum)
		}
	}
	blob := func(what string, d v1.Descriptor) []byte {
		t.Helper()
		b, ok := files["blobs/sha256/"+d.Digest.Hex]
		if d.Digest.Algorithm != "sha256" || !ok {
			t.Fatalf("%s %s: no such blob", what, d.Digest)
		}
		if int64(len(b)) != d.Size {
			t.Errorf("%s %s: size %d, the blob has %d bytes", what, d.Digest, d.Size, len(b))
		}
		return b
	}

	var index v1.IndexManifest
	if err := json.Unmarshal(files["index.json"], &index); err != nil {
		t.Fatalf("index.json: %v", err)
	}
	if index.SchemaVersion != 2 || index.MediaType != types.OCIImageIndex || len(index.Manifests) != 1 {
		t.Fatalf("index.json: schemaVersion %d mediaType %q, %d manifests; want 2, %s, 1",
			index.SchemaVersion, index.MediaType, len(index.Manifests), types.OCIImageIndex)
	}
	md := index.Manifests[0]
	if md.Digest.String() != oci.digest || md.MediaType != types.OCIManifestSchema1 {
		t.Errorf("index.json names %s (%s), stdout says %s", md.Digest, md.MediaType, oci.digest)
	}
	if got := md.Annotations["org.opencontainers.image.ref.name"]; got != "dev" {
		t.Errorf("ref.name annotation %q, want dev", got)
	}
	if got := md.Annotations["io.containerd.image.name"]; got != "ghcr.io/encgate/encgate:dev" {
		t.Errorf("io.containerd.image.name annotation %q, want ghcr.io/encgate/encgate:dev", got)
	}
	if md.Platform == nil || md.Platform.OS != "linux" || md.Platform.Architecture != runtime.GOARCH {
		t.Errorf("index.json platform %+v", md.Platform)
	}

	var m v1.Manifest
	if err := json.Unmarshal(blob("manifest", md), &m); err != nil {
		t.Fatal(err)
	}
	if m.Config.Digest.String() != oci.id || m.Config.MediaType != types.OCIConfigJSON {
		t.Errorf("manifest config %s (%s), stdout says image id %s", m.Config.Digest, m.Config.MediaType, oci.id)
	}
	if len(m.Layers) != 1 || m.Layers[0].MediaType != types.OCILayer {
		t.Fatalf("manifest layers %+v, want one %s", m.Layers, types.OCILayer)
	}
	blob("layer", m.Layers[0])
	var cf v1.ConfigFile
	if err := json.Unmarshal(blob("config", m.Config), &cf); err != nil {
		t.Fatal(err)
	}
	if want := []string{"gateway", "--config", configInImage}; !slices.Equal(cf.Config.Cmd, want) {
		t.Errorf("Cmd %q, want %q", cf.Config.Cmd, want)
	}
	if _, ok := cf.Config.ExposedPorts["9090/tcp"]; !ok || len(cf.Config.ExposedPorts) != 2 {
		t.Errorf("ExposedPorts %v, want 8080/tcp and 9090/tcp", cf.Config.ExposedPorts)
	}
	if cf.Config.User == "" || cf.Config.User == "root" || strings.HasPrefix(cf.Config.User, "0:") || cf.Config.User == "0" {
		t.Errorf("User %q: want a non-root user", cf.Config.User)
	}

	// The layout, unpacked, is one the library reads back as the same image.
	dir := t.TempDir()
	for name, body := range files {
		p := filepath.Join(dir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, body, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	img, err := idx.Image(md.Digest)
	if err != nil {
		t.Fatal(err)
	}
	if d, err := img.Digest(); err != nil || d.String() != oci.digest {
		t.Errorf("the layout's image reads back as %v (%v), want %s", d, err, oci.digest)
	}

	// The same inputs give the same bytes.
	again := runImage(t, testEpoch, "--version", "dev", "--format", "oci")
	a, _ := os.ReadFile(oci.path)
	b, _ := os.ReadFile(again.path)
	if !bytes.Equal(a, b) {
		t.Errorf("same inputs, different OCI tarballs (%d and %d bytes)", len(a), len(b))
	}
}

// TestContainerConfigRefusesLoopback: the config the image carries must
// listen on all interfaces; one on 127.0.0.1 would be unreachable through
// a published port, and the build says so.
func TestContainerConfigRefusesLoopback(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "configs"), 0o755); err != nil {
		t.Fatal(err)
	}
	conf := "listen: \"0.0.0.0:8080\"\nadmin_listen: \"127.0.0.1:9090\"\nencoders:\n  - {name: a, url: \"http://encoder-a:30000\"}\n"
	if err := os.WriteFile(filepath.Join(root, containerConfigSrc), []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	_, _, err := containerConfig(root)
	if err == nil || !strings.Contains(err.Error(), `admin_listen "127.0.0.1:9090" is one address only`) {
		t.Errorf("containerConfig = %v, want admin_listen refused", err)
	}
	conf = strings.Replace(conf, "127.0.0.1:9090", "0.0.0.0:9090", 1)
	if err := os.WriteFile(filepath.Join(root, containerConfigSrc), []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	raw, ports, err := containerConfig(root)
	if err != nil || string(raw) != conf || !slices.Equal(ports, []string{"8080/tcp", "9090/tcp"}) {
		t.Errorf("containerConfig = %d bytes, %q, %v; want the file, [8080/tcp 9090/tcp], nil", len(raw), ports, err)
	}
}
