package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
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

	"github.com/encgate/encgate/gateway"
)

// documentedNofile is the --ulimit nofile= that docs/getting-started/deploying.md
// and configs/gateway-containers.yaml put on their `docker run` and
// `podman run` lines; TestDocumentedRunLines keeps it, and them, above
// what the image's config can hold open.
const documentedNofile = "16384:16384"

// listeningLine is what the gateway logs once both listeners serve.
const listeningLine = `"msg":"gateway listening"`

// hostPort is a loopback port nothing listens on now, for a port to
// publish; the gateway (or the engine) binds it right after.
func hostPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	return strconv.Itoa(port)
}

// waitListening reads r (the gateway's log) until it says it is listening,
// then drains the rest in the background. It fails t with the lines read
// when the log ends first.
func waitListening(t *testing.T, r io.Reader) {
	t.Helper()
	sc := bufio.NewScanner(r)
	var seen []string
	for sc.Scan() {
		line := sc.Text()
		seen = append(seen, line)
		if strings.Contains(line, listeningLine) {
			go func() { _, _ = io.Copy(io.Discard, r) }()
			return
		}
	}
	t.Fatalf("the gateway's log ended (%v) before it said it was listening:\n%s", sc.Err(), strings.Join(seen, "\n"))
}

// checkProbes asks the admin listener at addr for /healthz and /readyz,
// once each: the listener already serves when the log says so.
func checkProbes(t *testing.T, addr string) {
	t.Helper()
	c := &http.Client{Timeout: 30 * time.Second}
	for path, want := range map[string]string{"/healthz": "ok\n", "/readyz": "ready\n"} {
		resp, err := c.Get("http://" + addr + path)
		if err != nil {
			t.Errorf("GET %s: %v", path, err)
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK || string(body) != want {
			t.Errorf("GET %s: %d %q, want 200 %q", path, resp.StatusCode, body, want)
		}
	}
}

// publish rewrites the config's listeners, "0.0.0.0:<port>", to free host
// ports, as `-p HOST:<port>` publishes a container's: it returns the new
// config and each container port's host port.
func publish(t *testing.T, config []byte) ([]byte, map[string]string) {
	t.Helper()
	ports := map[string]string{}
	re := regexp.MustCompile(`"0\.0\.0\.0:(\d+)"`)
	out := re.ReplaceAllFunc(config, func(m []byte) []byte {
		port := string(re.FindSubmatch(m)[1])
		if ports[port] == "" {
			ports[port] = hostPort(t)
		}
		return []byte(`"0.0.0.0:` + ports[port] + `"`)
	})
	if len(ports) == 0 {
		t.Fatalf("the image's config has no \"0.0.0.0:PORT\" listener:\n%s", config)
	}
	return out, ports
}

// TestImageRuns runs the image as a container runtime would, without one:
// the binary and the config taken out of the built tarball, the image's
// Entrypoint and Cmd as they are (only /etc/encgate/gateway.yaml becomes
// the extracted file, its listeners' ports moved to free ones as -p
// publishes them). The encoders it names (encoder-a, encoder-b) resolve
// only on a container network: the gateway must start and answer its
// probes without them. Nothing here needs a network beyond loopback.
// With ENCGATE_IMAGE_LOAD_TEST=1, TestImageTarball's "engine load" runs
// the same image in docker or podman.
func TestImageRuns(t *testing.T) {
	needArch(t)
	if runtime.GOOS != "linux" {
		t.Skipf("the image's binary is linux/%s; cannot run it on %s", runtime.GOARCH, runtime.GOOS)
	}
	r := readTarball(t, runImage(t, testEpoch, "--version", "dev").path)
	if r.bin == nil || r.config == nil {
		t.Fatal("the layer lacks /encgate or /etc/encgate/gateway.yaml")
	}
	cfg := r.cfg.Config
	argv := append(slices.Clone(cfg.Entrypoint), cfg.Cmd...)
	if len(argv) < 2 || argv[0] != "/encgate" || slices.Index(argv, configInImage) < 0 {
		t.Fatalf("Entrypoint+Cmd %q: want /encgate ... %s", argv, configInImage)
	}

	// The gateway refuses a config that RLIMIT_NOFILE cannot hold, as the
	// engine line's --ulimit provides for; this process's limit is what
	// the child gets.
	dir := t.TempDir()
	embedded := filepath.Join(dir, "embedded.yaml")
	if err := os.WriteFile(embedded, r.config, 0o644); err != nil {
		t.Fatal(err)
	}
	gcfg, err := gateway.LoadConfig(embedded)
	if err != nil {
		t.Fatalf("the image's config: %v", err)
	}
	if _, err := gateway.Descriptors(gcfg, nil, false); err != nil {
		t.Skipf("this machine's RLIMIT_NOFILE cannot hold the image's config (a container gets --ulimit nofile=%s): %v", documentedNofile, err)
	}
	config, ports := publish(t, r.config)
	confPath := filepath.Join(dir, "gateway.yaml")
	if err := os.WriteFile(confPath, config, 0o644); err != nil {
		t.Fatal(err)
	}
	for i, a := range argv {
		if a == configInImage {
			argv[i] = confPath
		}
	}
	admin := ports["9090"]
	if admin == "" {
		t.Fatalf("the image's config does not listen on 9090 (ports %v)", ports)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, writeBinary(t, r.bin), argv[1:]...)
	cmd.Dir = dir
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	waitListening(t, stderr)
	checkProbes(t, "127.0.0.1:"+admin)
}

// runEngine runs the loaded image in engine as the documented run line
// does (--ulimit nofile, both ports published, the image's own Cmd) and
// checks its probes. ENCGATE_IMAGE_ENGINE_FLAGS (before `run`, e.g.
// "--runtime runc") and ENCGATE_IMAGE_RUN_FLAGS (after it) add what a
// machine's engine needs. The engine refusing to start the container at
// all (exit 125-127: its runtime, cgroups, rlimits) skips, with its words.
func runEngine(t *testing.T, engine, image string) {
	t.Helper()
	front, admin := hostPort(t), hostPort(t)
	// A container the runtime refused to start still exists, created: the
	// name lets the cleanup remove it either way.
	name := "encgate-imagetest-" + strconv.Itoa(os.Getpid())
	t.Cleanup(func() {
		if out, err := exec.Command(engine, "rm", "-f", name).CombinedOutput(); err != nil {
			t.Logf("%s rm -f %s: %v\n%s", engine, name, err, out)
		}
	})
	args := append(strings.Fields(os.Getenv("ENCGATE_IMAGE_ENGINE_FLAGS")), "run", "-d", "--name", name,
		"--ulimit", "nofile="+documentedNofile, "-p", "127.0.0.1:"+front+":8080", "-p", "127.0.0.1:"+admin+":9090")
	args = append(append(args, strings.Fields(os.Getenv("ENCGATE_IMAGE_RUN_FLAGS"))...), image)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, engine, args...).Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() >= 125 && ee.ExitCode() <= 127 {
		t.Skipf("%s %s refused to start the container (exit %d): %s",
			engine, strings.Join(args, " "), ee.ExitCode(), strings.TrimSpace(string(ee.Stderr)))
	}
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", engine, strings.Join(args, " "), err, out)
	}
	id := strings.TrimSpace(string(out))
	logs := exec.CommandContext(ctx, engine, "logs", "-f", id)
	pr, pw := io.Pipe()
	logs.Stdout, logs.Stderr = pw, pw
	if err := logs.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { pw.CloseWithError(fmt.Errorf("%s logs: %v", engine, logs.Wait())) }()
	waitListening(t, pr)
	checkProbes(t, "127.0.0.1:"+admin)
}

// nofile is a fixed RLIMIT_NOFILE, soft and hard.
type nofile uint64

func (n nofile) Get() (uint64, uint64, error) { return uint64(n), uint64(n), nil }
func (nofile) Set(uint64, uint64) error       { return errors.New("fixed") }

// TestDocumentedRunLines: the run lines in the deploying guide and in the
// image's config give the container an RLIMIT_NOFILE that holds what that
// config can hold open (the gateway refuses to start otherwise), publish
// both its ports, and are the same --ulimit the engine test uses; the
// number of descriptors both say the config needs is the gateway's sum.
func TestDocumentedRunLines(t *testing.T) {
	cfg, err := gateway.LoadConfig(filepath.Join("..", "..", containerConfigSrc))
	if err != nil {
		t.Fatal(err)
	}
	soft, err := strconv.ParseUint(strings.Split(documentedNofile, ":")[0], 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	report, err := gateway.Descriptors(cfg, nofile(soft), false)
	if err != nil {
		t.Errorf("--ulimit nofile=%s does not fit %s: %v", documentedNofile, containerConfigSrc, err)
	}
	need := strconv.FormatUint(report.Limits.Need, 10)
	ulimit := regexp.MustCompile(`--ulimit nofile=(\d+(?::\d+)?)`)
	needs := regexp.MustCompile(`(\d+) descriptors`)
	for _, f := range []string{"docs/getting-started/deploying.md", containerConfigSrc} {
		b, err := os.ReadFile(filepath.Join("..", "..", f))
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		ms := ulimit.FindAllStringSubmatch(text, -1)
		if len(ms) == 0 {
			t.Errorf("%s shows no run line with --ulimit nofile=", f)
		}
		for _, m := range ms {
			if m[1] != documentedNofile {
				t.Errorf("%s: --ulimit nofile=%s, want %s", f, m[1], documentedNofile)
			}
		}
		if ms := needs.FindAllStringSubmatch(text, -1); len(ms) == 0 {
			t.Errorf("%s does not say how many descriptors the config needs (%s)", f, need)
		} else {
			for _, m := range ms {
				if m[1] != need {
					t.Errorf("%s says %s descriptors, the config needs %s", f, m[1], need)
				}
			}
		}
		for _, want := range []string{"docker run", "podman run", "-p 8080:8080", "-p 9090:9090"} {
			if !strings.Contains(text, want) {
				t.Errorf("%s does not show %q", f, want)
			}
		}
	}
}
