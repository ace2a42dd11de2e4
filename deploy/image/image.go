package main

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/encgate/encgate/gateway"
)

const (
	modulePath = "github.com/encgate/encgate"
	sourceURL  = "https://" + modulePath
	// nonroot is the uid:gid the image runs as (the "nonroot" user of the
	// distroless images; no /etc/passwd entry is needed for a numeric user).
	nonroot = "65532:65532"

	// containerConfigSrc is the gateway config the image carries, from the
	// module root; configInImage is where it sits in the image, and the
	// default Cmd runs the gateway on it.
	containerConfigSrc = "configs/gateway-containers.yaml"
	configInImage      = "/etc/encgate/gateway.yaml"
)

// defaultCmd is the image's Cmd: with the entrypoint /encgate, a bare
// `docker run IMAGE` runs the gateway on the config the image carries.
var defaultCmd = []string{"gateway", "--config", configInImage}

// archMachine maps the GOARCH values this program builds for to the ELF
// machine a linux binary for them has. Their OCI architecture names are the
// GOARCH names themselves (no variant is needed, unlike arm/v7).
var archMachine = map[string]elf.Machine{
	"amd64":   elf.EM_X86_64,
	"arm64":   elf.EM_AARCH64,
	"ppc64le": elf.EM_PPC64,
	"riscv64": elf.EM_RISCV,
	"s390x":   elf.EM_S390,
}

func supportedArchs() string {
	names := make([]string, 0, len(archMachine))
	for a := range archMachine {
		names = append(names, a)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

func checkArch(arch string) error {
	if _, ok := archMachine[arch]; !ok {
		return fmt.Errorf("unsupported --arch %q (supported: %s)", arch, supportedArchs())
	}
	return nil
}

// checkVersion keeps the version safe to pass inside -ldflags, which the go
// command splits on spaces and quotes.
func checkVersion(v string) error {
	if v == "" || strings.ContainsAny(v, " \t\r\n'\"\\") {
		return fmt.Errorf("bad version %q: it must be non-empty, with no spaces, quotes or backslashes", v)
	}
	return nil
}

// sourceDateEpoch is the image's creation time and every file's mtime:
// $SOURCE_DATE_EPOCH (https://reproducible-builds.org/specs/source-date-epoch/)
// when set, else the Unix epoch, so that builds never depend on the clock.
func sourceDateEpoch(s string) (time.Time, error) {
	if s == "" {
		return time.Unix(0, 0).UTC(), nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH=%q: want a non-negative integer (seconds since 1970)", s)
	}
	return time.Unix(n, 0).UTC(), nil
}

// moduleRoot finds the encgate module's directory with `go env GOMOD`, and
// refuses to go on from inside any other module.
func moduleRoot(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return "", fmt.Errorf("go env GOMOD: %v\n%s", err, ee.Stderr)
		}
		return "", fmt.Errorf("go env GOMOD: %w (is the go command on PATH?)", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("not inside a Go module: run this from the encgate checkout (go run ./deploy/image ...)")
	}
	f, err := os.Open(gomod)
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "module" {
			if p := strings.Trim(fields[1], `"`); p != modulePath {
				return "", fmt.Errorf("%s is module %s, not %s: run this from the encgate checkout", gomod, p, modulePath)
			}
			return filepath.Dir(gomod), nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	return "", fmt.Errorf("%s has no module line", gomod)
}

// git runs git in dir and returns its trimmed output, or "" when git is
// missing or dir is not a git checkout (a source tarball, say).
func git(ctx context.Context, dir string, args ...string) string {
	cmd := exec.CommandContext(ctx, "git", append([]string{"-C", dir}, args...)...)
	out, err := cmd.Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(out))
}

func gitDescribe(ctx context.Context, dir string) string {
	return git(ctx, dir, "describe", "--always", "--dirty")
}

func gitHead(ctx context.Context, dir string) string {
	return git(ctx, dir, "rev-parse", "HEAD")
}

// buildBinary compiles the encgate command at root into dir/encgate: linux,
// static (CGO off, and -tags nocuda: the CUDA driver loader links the
// dynamic loader in, which the scratch image lacks, so the image's agent
// refuses stages by CUDA IPC handle, naming the tag), reproducible
// (-trimpath), stripped, with the version set. The go command's output is
// in the error when it fails.
func buildBinary(ctx context.Context, root, arch, version, dir string) (string, error) {
	if err := checkArch(arch); err != nil {
		return "", err
	}
	if err := checkVersion(version); err != nil {
		return "", err
	}
	out := filepath.Join(dir, "encgate")
	args := []string{"build", "-trimpath", "-tags", "nocuda", "-ldflags", "-s -w -X main.version=" + version, "-o", out, "."}
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
	if output, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("CGO_ENABLED=0 GOOS=linux GOARCH=%s go %s (in %s) failed: %v\n%s",
			arch, strings.Join(quoteArgs(args), " "), root, err, bytes.TrimSpace(output))
	}
	if err := checkStatic(out, arch); err != nil {
		return "", err
	}
	return out, nil
}

func quoteArgs(args []string) []string {
	q := make([]string, len(args))
	for i, a := range args {
		if strings.ContainsAny(a, " \t") {
			a = "'" + a + "'"
		}
		q[i] = a
	}
	return q
}

// checkStatic makes sure path is a linux ELF binary for arch with no
// program interpreter: an image from scratch has no dynamic loader.
func checkStatic(path, arch string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("%s: not an ELF binary: %w", path, err)
	}
	defer f.Close()
	if want := archMachine[arch]; f.Machine != want {
		return fmt.Errorf("%s: ELF machine %v, want %v for %s", path, f.Machine, want, arch)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is dynamically linked (it has a PT_INTERP program header); the image has no libc or loader", path)
		}
	}
	return nil
}

// imageSpec is everything besides the binary that goes into the image.
type imageSpec struct {
	Arch     string    // GOARCH, also the OCI architecture
	Version  string    // org.opencontainers.image.version
	Revision string    // org.opencontainers.image.revision; "" leaves it out
	Created  time.Time // config created time and every file's mtime
	Config   []byte    // the gateway config at configInImage
	Ports    []string  // ExposedPorts, "8080/tcp"...: the config's listeners
}

// containerConfig reads the config the image carries (containerConfigSrc
// under root), loads it as `encgate gateway --check` would, and returns its
// bytes and the ports its listeners take ("8080/tcp", ...), which the image
// exposes. A listener bound to one address (127.0.0.1, the defaults) is
// refused: a published port reaches the container's own interface, never
// its loopback, so such a gateway would be unreachable.
func containerConfig(root string) ([]byte, []string, error) {
	path := filepath.Join(root, containerConfigSrc)
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	cfg, err := gateway.LoadConfig(path)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", containerConfigSrc, err)
	}
	var ports []string
	for _, l := range []struct{ key, addr string }{
		{"listen", cfg.Listen},
		{"admin_listen", cfg.AdminListen},
		{"bootstrap.listen", cfg.Bootstrap.Listen},
	} {
		if l.addr == "" { // bootstrap off
			continue
		}
		host, port, err := net.SplitHostPort(l.addr)
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %s %q: %w", containerConfigSrc, l.key, l.addr, err)
		}
		if host != "" && host != "0.0.0.0" && host != "::" {
			return nil, nil, fmt.Errorf("%s: %s %q is one address only, unreachable through a published port: the image's config must listen on all interfaces (0.0.0.0)",
				containerConfigSrc, l.key, l.addr)
		}
		ports = append(ports, port+"/tcp")
	}
	return raw, ports, nil
}

// layerTar is the image's only layer, uncompressed: /encgate, the gateway
// config at /etc/encgate/gateway.yaml and /tmp. Every header field is fixed
// (owner root, mtime created), so the same binary and config give the same
// bytes. The config is world-readable (the image runs as 65532) and owned
// by root, so the gateway cannot change it.
//
// /tmp is an empty, world-writable, sticky directory. `encgate gateway`
// and `encgate agent` do not need it (the agent makes its temporary socket
// directory next to the configured socket path); `encgate demo` does
// (os.MkdirTemp), and so would a debugging session or a future feature. In
// Kubernetes with readOnlyRootFilesystem it should be an emptyDir anyway.
func layerTar(bin, config []byte, created time.Time) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	hdrs := []struct {
		hdr  tar.Header
		body []byte
	}{
		{tar.Header{Typeflag: tar.TypeReg, Name: "encgate", Mode: 0o755, Size: int64(len(bin))}, bin},
		{tar.Header{Typeflag: tar.TypeDir, Name: "etc/", Mode: 0o755}, nil},
		{tar.Header{Typeflag: tar.TypeDir, Name: "etc/encgate/", Mode: 0o755}, nil},
		{tar.Header{Typeflag: tar.TypeReg, Name: strings.TrimPrefix(configInImage, "/"), Mode: 0o644, Size: int64(len(config))}, config},
		{tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777}, nil}, // 01000 is the sticky bit
	}
	for _, e := range hdrs {
		h := e.hdr
		h.Uid, h.Gid = 0, 0
		h.ModTime = created
		h.Format = tar.FormatUSTAR
		if err := tw.WriteHeader(&h); err != nil {
			return nil, fmt.Errorf("layer: %s: %w", h.Name, err)
		}
		if _, err := tw.Write(e.body); err != nil {
			return nil, fmt.Errorf("layer: %s: %w", h.Name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}
	return buf.Bytes(), nil
}

// buildImage assembles the image from scratch (empty.Image, nothing
// downloaded) around the binary at binPath.
func buildImage(binPath string, s imageSpec) (v1.Image, error) {
	if err := checkArch(s.Arch); err != nil {
		return nil, err
	}
	bin, err := os.ReadFile(binPath)
	if err != nil {
		return nil, err
	}
	if len(s.Config) == 0 || len(s.Ports) == 0 {
		return nil, errors.New("no container config (containerConfig) in the image spec")
	}
	raw, err := layerTar(bin, s.Config, s.Created)
	if err != nil {
		return nil, err
	}
	// The tarball package gzips the layer (deterministically: the gzip
	// header carries no name or time); caching keeps it from gzipping the
	// same bytes again for the digest, the size and the write.
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(raw)), nil
	}, tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
	if err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}

	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	// mutate.Append is mutate.AppendLayers plus a history entry, which is
	// what `docker history` shows for the layer.
	img, err = mutate.Append(img, mutate.Addendum{
		Layer: layer,
		History: v1.History{
			Created:   v1.Time{Time: s.Created},
			CreatedBy: "go run ./deploy/image",
			Comment:   "static encgate binary (CGO_ENABLED=0) at /encgate, " + containerConfigSrc + " at " + configInImage + ", empty /tmp",
		},
	})
	if err != nil {
		return nil, err
	}

	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS = "linux"
	cf.Architecture = s.Arch
	cf.Created = v1.Time{Time: s.Created}
	labels := map[string]string{
		"org.opencontainers.image.title":       "encgate",
		"org.opencontainers.image.description": "encgate: a gateway for fleets of sglang multimodal encoders, and its per-node agent",
		"org.opencontainers.image.version":     s.Version,
		"org.opencontainers.image.source":      sourceURL,
	}
	if s.Revision != "" {
		labels["org.opencontainers.image.revision"] = s.Revision
	}
	exposed := make(map[string]struct{}, len(s.Ports))
	for _, p := range s.Ports {
		exposed[p] = struct{}{}
	}
	cf.Config = v1.Config{
		Entrypoint:   []string{"/encgate"},
		Cmd:          append([]string(nil), defaultCmd...),
		ExposedPorts: exposed,
		User:         nonroot,
		WorkingDir:   "/",
		Labels:       labels,
	}
	return mutate.ConfigFile(img, cf)
}
