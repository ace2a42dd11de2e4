package main

import (
	"archive/tar"
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/encgate/encgate/internal/testtool"
)

// testEpoch is the SOURCE_DATE_EPOCH the tests build with, so that the
// created time and mtimes they check are not the zero default by accident.
const testEpoch = 1700000000

// built is what one run of the program reports and writes.
type built struct {
	path   string
	size   int64  // from "wrote FILE (N bytes)"
	digest string // manifest digest
	id     string // config digest
	stdout string
}

var (
	wroteRE  = regexp.MustCompile(`(?m)^wrote (.+) \((\d+) bytes\)$`)
	digestRE = regexp.MustCompile(`(?m)^  digest   (sha256:[0-9a-f]{64})$`)
	idRE     = regexp.MustCompile(`(?m)^  image id (sha256:[0-9a-f]{64})$`)
)

// needArch skips when this machine's GOARCH is not one the program builds
// for (its default --arch would be refused).
func needArch(t *testing.T) {
	t.Helper()
	if err := checkArch(runtime.GOARCH); err != nil {
		t.Skipf("GOARCH %s: %v", runtime.GOARCH, err)
	}
}

// runImage runs the program in-process, with SOURCE_DATE_EPOCH=epoch, and
// writes the tarball to a fresh file.
func runImage(t *testing.T, epoch int64, args ...string) built {
	t.Helper()
	t.Setenv("SOURCE_DATE_EPOCH", strconv.FormatInt(epoch, 10))
	out := filepath.Join(t.TempDir(), "img.tar")
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if code := run(ctx, append([]string{"--out", out}, args...), &stdout, &stderr); code != 0 {
		t.Fatalf("run %v: exit %d\nstdout:\n%s\nstderr:\n%s", args, code, &stdout, &stderr)
	}
	b := built{path: out, stdout: stdout.String()}
	m := wroteRE.FindStringSubmatch(b.stdout)
	if m == nil || m[1] != out {
		t.Fatalf("stdout does not say it wrote %s:\n%s", out, b.stdout)
	}
	b.size, _ = strconv.ParseInt(m[2], 10, 64)
	if m := digestRE.FindStringSubmatch(b.stdout); m != nil {
		b.digest = m[1]
	} else {
		t.Fatalf("stdout has no digest line:\n%s", b.stdout)
	}
	if m := idRE.FindStringSubmatch(b.stdout); m != nil {
		b.id = m[1]
	} else {
		t.Fatalf("stdout has no image id line:\n%s", b.stdout)
	}
	st, err := os.Stat(out)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() != b.size {
		t.Errorf("stdout says %d bytes, the file has %d", b.size, st.Size())
	}
	return b
}

// readBack is the tarball as the library reads it.
type readBack struct {
	manifest tarball.Manifest
	img      v1.Image
	cfg      *v1.ConfigFile
	entries  map[string]*tar.Header // the layer's entries by name
	bin      []byte                 // the layer's /encgate
	config   []byte                 // the layer's /etc/encgate/gateway.yaml
}

func readTarball(t *testing.T, path string) readBack {
	t.Helper()
	var r readBack
	var err error
	r.manifest, err = tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(path) })
	if err != nil {
		t.Fatalf("manifest.json: %v", err)
	}
	if r.img, err = tarball.ImageFromPath(path, nil); err != nil {
		t.Fatalf("ImageFromPath: %v", err)
	}
	if r.cfg, err = r.img.ConfigFile(); err != nil {
		t.Fatal(err)
	}
	layers, err := r.img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	if len(layers) != 1 {
		t.Fatalf("%d layers, want exactly 1", len(layers))
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	r.entries = map[string]*tar.Header{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("layer tar: %v", err)
		}
		if _, dup := r.entries[h.Name]; dup {
			t.Errorf("layer has %q twice", h.Name)
		}
		r.entries[h.Name] = h
		switch h.Name {
		case "encgate":
			if r.bin, err = io.ReadAll(tr); err != nil {
				t.Fatalf("layer tar: encgate: %v", err)
			}
		case "etc/encgate/gateway.yaml":
			if r.config, err = io.ReadAll(tr); err != nil {
				t.Fatalf("layer tar: %s: %v", h.Name, err)
			}
		}
	}
	return r
}

// writeBinary puts the extracted binary in a temp file, mode 0755.
func writeBinary(t *testing.T, bin []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "encgate")
	if err := os.WriteFile(p, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// runVersion runs `<bin> version` and returns its stdout.
func runVersion(t *testing.T, bin string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, "version")
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s version: %v\n%s", bin, err, &stderr)
	}
	return stdout.String()
}

func TestImageTarball(t *testing.T) {
	needArch(t)
	b := runImage(t, testEpoch, "--version", "dev")
	r := readTarball(t, b.path)

	t.Run("manifest.json", func(t *testing.T) {
		if len(r.manifest) != 1 {
			t.Fatalf("manifest.json has %d images, want 1", len(r.manifest))
		}
		m := r.manifest[0]
		if want := []string{"ghcr.io/encgate/encgate:dev"}; !slices.Equal(m.RepoTags, want) {
			t.Errorf("RepoTags %q, want %q (what docker load tags and the manifests name)", m.RepoTags, want)
		}
		if m.Config != b.id {
			t.Errorf("manifest.json config %s, stdout says image id %s", m.Config, b.id)
		}
		if len(m.Layers) != 1 {
			t.Errorf("manifest.json lists %d layers, want 1", len(m.Layers))
		}
	})

	t.Run("config", func(t *testing.T) {
		c := r.cfg.Config
		if !slices.Equal(c.Entrypoint, []string{"/encgate"}) {
			t.Errorf("Entrypoint %q, want [/encgate]", c.Entrypoint)
		}
		// A bare `docker run IMAGE` runs the gateway on the config the
		// image carries, rather than printing usage and exiting 2.
		if want := []string{"gateway", "--config", "/etc/encgate/gateway.yaml"}; !slices.Equal(c.Cmd, want) {
			t.Errorf("Cmd %q, want %q", c.Cmd, want)
		}
		// configs/gateway-containers.yaml listens on 8080 and 9090.
		var ports []string
		for p := range c.ExposedPorts {
			ports = append(ports, p)
		}
		slices.Sort(ports)
		if want := []string{"8080/tcp", "9090/tcp"}; !slices.Equal(ports, want) {
			t.Errorf("ExposedPorts %q, want %q (listen and admin_listen of configs/gateway-containers.yaml)", ports, want)
		}
		if c.User != "65532:65532" {
			t.Errorf("User %q, want 65532:65532 (non-root)", c.User)
		}
		if c.WorkingDir != "/" {
			t.Errorf("WorkingDir %q, want /", c.WorkingDir)
		}
		if r.cfg.OS != "linux" || r.cfg.Architecture != runtime.GOARCH {
			t.Errorf("platform %s/%s, want linux/%s", r.cfg.OS, r.cfg.Architecture, runtime.GOARCH)
		}
		if want := time.Unix(testEpoch, 0); !r.cfg.Created.Time.Equal(want) {
			t.Errorf("created %v, want SOURCE_DATE_EPOCH %v", r.cfg.Created.Time, want.UTC())
		}
		for k, want := range map[string]string{
			"org.opencontainers.image.title":   "encgate",
			"org.opencontainers.image.version": "dev",
			"org.opencontainers.image.source":  "https://github.com/encgate/encgate",
		} {
			if got := c.Labels[k]; got != want {
				t.Errorf("label %s = %q, want %q", k, got, want)
			}
		}
		if c.Labels["org.opencontainers.image.description"] == "" {
			t.Error("no org.opencontainers.image.description label")
		}
		if rev, ok := c.Labels["org.opencontainers.image.revision"]; ok && !regexp.MustCompile(`^[0-9a-f]{40,64}$`).MatchString(rev) {
			t.Errorf("revision label %q is not a git commit id", rev)
		}
		id, err := r.img.ConfigName()
		if err != nil {
			t.Fatal(err)
		}
		if id.String() != b.id {
			t.Errorf("config digest read back %s, stdout says %s", id, b.id)
		}
	})

	t.Run("layer", func(t *testing.T) {
		want := []string{"encgate", "etc/", "etc/encgate/", "etc/encgate/gateway.yaml", "tmp/"}
		names := make([]string, 0, len(r.entries))
		for n := range r.entries {
			names = append(names, n)
		}
		slices.Sort(names)
		if !slices.Equal(names, want) {
			t.Errorf("layer entries %q, want exactly %q", names, want)
		}
		mtime := time.Unix(testEpoch, 0)
		for _, n := range []string{"etc/", "etc/encgate/", "etc/encgate/gateway.yaml"} {
			h := r.entries[n]
			if h == nil {
				continue
			}
			typ, mode := byte(tar.TypeDir), int64(0o755)
			if n == "etc/encgate/gateway.yaml" {
				typ, mode = tar.TypeReg, 0o644
			}
			if h.Typeflag != typ || h.Mode != mode || h.Uid != 0 || h.Gid != 0 || !h.ModTime.Equal(mtime) {
				t.Errorf("%s: type %c mode %o uid %d gid %d mtime %v, want type %c mode %o owned by 0:0 at %v",
					n, h.Typeflag, h.Mode, h.Uid, h.Gid, h.ModTime, typ, mode, mtime.UTC())
			}
		}
		src, err := os.ReadFile(filepath.Join("..", "..", "configs", "gateway-containers.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(r.config, src) {
			t.Errorf("/etc/encgate/gateway.yaml (%d bytes) is not configs/gateway-containers.yaml (%d bytes)", len(r.config), len(src))
		}
		if h := r.entries["encgate"]; h == nil {
			t.Error("layer has no encgate")
		} else {
			if h.Typeflag != tar.TypeReg || h.Mode != 0o755 || h.Uid != 0 || h.Gid != 0 {
				t.Errorf("encgate: type %c mode %o uid %d gid %d, want a regular file 0755 owned by 0:0", h.Typeflag, h.Mode, h.Uid, h.Gid)
			}
			if !h.ModTime.Equal(mtime) {
				t.Errorf("encgate mtime %v, want %v", h.ModTime, mtime.UTC())
			}
		}
		if h := r.entries["tmp/"]; h == nil {
			t.Error("layer has no tmp/")
		} else {
			if h.Typeflag != tar.TypeDir || h.Mode != 0o1777 || h.Uid != 0 || h.Gid != 0 {
				t.Errorf("tmp/: type %c mode %o uid %d gid %d, want a directory 01777 owned by 0:0", h.Typeflag, h.Mode, h.Uid, h.Gid)
			}
			if !h.ModTime.Equal(mtime) {
				t.Errorf("tmp/ mtime %v, want %v", h.ModTime, mtime.UTC())
			}
		}
	})

	if r.bin == nil {
		t.Fatal("no /encgate in the layer")
	}
	bin := writeBinary(t, r.bin)

	t.Run("static", func(t *testing.T) {
		f, err := elf.Open(bin)
		if err != nil {
			t.Fatalf("/encgate is not ELF: %v", err)
		}
		defer f.Close()
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP {
				t.Fatal("/encgate has a PT_INTERP program header: dynamically linked, it cannot run from scratch")
			}
		}
		if f.Machine != archMachine[runtime.GOARCH] {
			t.Errorf("ELF machine %v, want %v", f.Machine, archMachine[runtime.GOARCH])
		}
	})

	t.Run("version", func(t *testing.T) {
		if runtime.GOOS != "linux" {
			t.Skipf("the image's binary is linux/%s; cannot run it on %s", runtime.GOARCH, runtime.GOOS)
		}
		out := runVersion(t, bin)
		if !strings.HasPrefix(out, "encgate ") || !strings.Contains(out, "dev") {
			t.Errorf("encgate version printed %q, want \"encgate dev...\"", out)
		}
	})

	// Loading into a container engine changes its image store, so it is
	// opt-in: ENCGATE_IMAGE_LOAD_TEST=1 with docker or podman working. It
	// loads the tarball and runs the gateway the image's Cmd starts
	// (runEngine).
	t.Run("engine load", func(t *testing.T) {
		if os.Getenv("ENCGATE_IMAGE_LOAD_TEST") != "1" {
			t.Skip("set ENCGATE_IMAGE_LOAD_TEST=1 to docker/podman load the tarball")
		}
		engine := ""
		for _, e := range []string{"docker", "podman"} {
			if _, err := exec.LookPath(e); err == nil && exec.Command(e, "info").Run() == nil {
				engine = e
				break
			}
		}
		if engine == "" {
			testtool.Missing(t, "a working docker or podman", "podman", "ENCGATE_IMAGE_LOAD_TEST=1 asks to load the tarball into one")
		}
		out, err := exec.Command(engine, "load", "-i", b.path).CombinedOutput()
		if err != nil {
			t.Fatalf("%s load: %v\n%s", engine, err, out)
		}
		if !strings.Contains(string(out), "ghcr.io/encgate/encgate:dev") {
			t.Errorf("%s load output does not name the tag:\n%s", engine, out)
		}
		runEngine(t, engine, "ghcr.io/encgate/encgate:dev")
	})
}

// TestReproducible builds the image twice from the same inputs: the same
// digest and the same bytes. A third build with another SOURCE_DATE_EPOCH
// must differ, or the first comparison proves nothing about the inputs.
func TestReproducible(t *testing.T) {
	needArch(t)
	a := runImage(t, testEpoch, "--version", "dev")
	b := runImage(t, testEpoch, "--version", "dev")
	if a.digest != b.digest || a.id != b.id {
		t.Errorf("same inputs, different images:\n  %s (id %s)\n  %s (id %s)", a.digest, a.id, b.digest, b.id)
	}
	ab, err := os.ReadFile(a.path)
	if err != nil {
		t.Fatal(err)
	}
	bb, err := os.ReadFile(b.path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ab, bb) {
		t.Errorf("same inputs, different tarballs (%d and %d bytes)", len(ab), len(bb))
	}
	c := runImage(t, testEpoch+1, "--version", "dev")
	if c.digest == a.digest {
		t.Errorf("SOURCE_DATE_EPOCH %d and %d gave the same digest %s", testEpoch, testEpoch+1, a.digest)
	}
}

// TestVersionAndTag: --version reaches the binary (through -X), the labels
// and the default tag; --tag replaces the tag.
func TestVersionAndTag(t *testing.T) {
	needArch(t)
	const v = "v0.0.0-imagetest"
	r := readTarball(t, runImage(t, testEpoch, "--version", v).path)
	if want := []string{"ghcr.io/encgate/encgate:" + v}; len(r.manifest) != 1 || !slices.Equal(r.manifest[0].RepoTags, want) {
		t.Errorf("manifest.json %+v, want RepoTags %q", r.manifest, want)
	}
	if got := r.cfg.Config.Labels["org.opencontainers.image.version"]; got != v {
		t.Errorf("version label %q, want %q", got, v)
	}
	if runtime.GOOS == "linux" {
		if out := runVersion(t, writeBinary(t, r.bin)); !strings.HasPrefix(out, "encgate "+v) {
			t.Errorf("encgate version printed %q, want \"encgate %s...\"", out, v)
		}
	}

	const tag = "registry.example.com/team/encgate:canary"
	r = readTarball(t, runImage(t, testEpoch, "--version", v, "--tag", tag).path)
	if len(r.manifest) != 1 || !slices.Equal(r.manifest[0].RepoTags, []string{tag}) {
		t.Errorf("manifest.json %+v, want RepoTags [%s]", r.manifest, tag)
	}
}

// TestUsageErrors: bad flags and environment fail fast, exit 2, say what is
// wrong, and write nothing.
func TestUsageErrors(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "img.tar")
	for _, tc := range []struct {
		name  string
		args  []string
		epoch string
		want  string
	}{
		{"no out", []string{"--version", "dev"}, "", "--out is required"},
		{"bad arch", []string{"--out", out, "--arch", "mips"}, "", `unsupported --arch "mips"`},
		{"bad tag", []string{"--out", out, "--tag", "Not A Tag"}, "", `bad tag "Not A Tag"`},
		{"bad version", []string{"--out", out, "--version", "1 2"}, "", `bad version "1 2"`},
		{"bad epoch", []string{"--out", out}, "-5", `SOURCE_DATE_EPOCH="-5"`},
		{"extra arg", []string{"--out", out, "extra"}, "", `unexpected argument "extra"`},
		{"bad format", []string{"--out", out, "--format", "tar"}, "", `unknown --format "tar"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("SOURCE_DATE_EPOCH", tc.epoch)
			var stdout, stderr bytes.Buffer
			code := run(context.Background(), tc.args, &stdout, &stderr)
			if code != 2 {
				t.Errorf("exit %d, want 2", code)
			}
			if !strings.Contains(stderr.String(), tc.want) {
				t.Errorf("stderr %q does not say %q", stderr.String(), tc.want)
			}
			if entries, _ := os.ReadDir(dir); len(entries) != 0 {
				t.Errorf("it wrote %v", entries)
			}
		})
	}
}

// writeModule makes a one-file module at a temp dir.
func writeModule(t *testing.T, module, mainGo string) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module "+module+"\n\ngo 1.21\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(mainGo), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestBuildFailureShowsOutput: when go build fails, the error carries the
// compiler's own message.
func TestBuildFailureShowsOutput(t *testing.T) {
	t.Setenv("GOWORK", "off")
	root := writeModule(t, "example.com/broken", "package main\n\nfunc main() { undefinedThing() }\n")
	_, err := buildBinary(context.Background(), root, "amd64", "dev", t.TempDir())
	if err == nil {
		t.Fatal("a broken module built")
	}
	for _, want := range []string{"go build", "undefined: undefinedThing"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not say %q:\n%v", want, err)
		}
	}
}

// TestWrongModule: run from inside another module, it refuses to build
// that module's main package.
func TestWrongModule(t *testing.T) {
	t.Setenv("GOWORK", "off")
	t.Chdir(writeModule(t, "example.com/other", "package main\n\nfunc main() {}\n"))
	out := filepath.Join(t.TempDir(), "img.tar")
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"--out", out}, &stdout, &stderr); code != 1 {
		t.Errorf("exit %d, want 1", code)
	}
	if want := "is module example.com/other, not github.com/encgate/encgate"; !strings.Contains(stderr.String(), want) {
		t.Errorf("stderr %q does not say %q", stderr.String(), want)
	}
	if _, err := os.Stat(out); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("it wrote %s (%v)", out, err)
	}
}

// TestCheckStatic: the program itself refuses a dynamically linked binary
// (here the system's /bin/sh, when that is a dynamic ELF).
func TestCheckStatic(t *testing.T) {
	f, err := elf.Open("/bin/sh")
	if err != nil {
		t.Skipf("no ELF /bin/sh: %v", err)
	}
	arch := ""
	for a, m := range archMachine {
		if m == f.Machine {
			arch = a
		}
	}
	dynamic := false
	for _, p := range f.Progs {
		dynamic = dynamic || p.Type == elf.PT_INTERP
	}
	f.Close()
	if arch == "" || !dynamic {
		t.Skipf("/bin/sh is not a dynamic ELF binary for a supported arch (machine %v)", f.Machine)
	}
	err = checkStatic("/bin/sh", arch)
	if err == nil || !strings.Contains(err.Error(), "dynamically linked") {
		t.Errorf("checkStatic(/bin/sh) = %v, want a dynamically linked error", err)
	}
}
