// Command encgate is a gateway for fleets of sglang multimodal encoders.
//
//	encgate gateway --config FILE [--check]   serve (or validate a config)
//	encgate agent --config FILE [--check]     the per-node gpuagent
//	encgate fake-encoder --listen ADDR ...    a faithful fake sglang encoder
//	encgate demo                              a whole local fleet, end to end
//	encgate version
//	encgate help [COMMAND]                    (or COMMAND --help)
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/encgate/encgate/demo"
	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/gateway"
	"github.com/encgate/encgate/gpuagent"
	"github.com/encgate/encgate/internal/listener"
	"github.com/encgate/encgate/internal/redisclient"

	// The image (deploy/image) is built from scratch and holds no CA
	// certificates: crypto/x509 uses these roots (Mozilla's, kept by
	// x/crypto) only when the system offers none, so https encoders and
	// agents verify inside the image too.
	_ "golang.org/x/crypto/x509roots/fallback"
)

// version is set at build time with -ldflags "-X main.version=v1.2.3"
// (the image builder sets it, "dev" included). Unset, it is the module
// version the go command stamped from the checkout, else "dev".
var version string

const usage = `encgate — a gateway for fleets of sglang multimodal encoders

usage:
  encgate gateway --config FILE [--check]
  encgate agent --config FILE [--check]
  encgate fake-encoder --listen ADDR [--name N] [--mode mooncake|zmq] [--register-url URL ...] [--cache-items N] [fault flags]
  encgate demo
  encgate version
  encgate help [COMMAND]

"encgate COMMAND --help" describes every flag of COMMAND.
`

// Each command's help: what it does, then (from its FlagSet) every flag.
const (
	gatewayHelp = `usage: encgate gateway --config FILE [--check]

Serve the gateway in front of the config's encoders, on its listen,
admin_listen and (when set) bootstrap.listen addresses. SIGHUP reloads the
config (an invalid one is refused and the running config stays); SIGINT or
SIGTERM drains (shutdown.delay, then shutdown.grace).

flags:
`
	agentHelp = `usage: encgate agent --config FILE [--check]

Serve the per-node gpuagent: it holds the embeddings the node's encoder
stages over a Unix socket and performs sglang's /send for them, writing
the bytes into the receiver's buffer over Mooncake's TCP transport.
SIGINT or SIGTERM drains (shutdown.grace).

flags:
`
	fakeEncoderHelp = `usage: encgate fake-encoder [flags]

Serve a fake sglang encoder (the HTTP API of sglang's encode server) with
injectable faults, for tests and demos. SIGINT or SIGTERM unregisters from
every --register-url and exits.

flags:
`
	demoHelp = `usage: encgate demo

Run a whole local fleet end to end (3 fake encoders with their gpuagents,
one gateway, one receiver, an sglang-like workload; then an encoder that
joins by registration and drains), print a summary, and exit non-zero if
any invariant it checks fails. It takes no flags.
`
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "gateway":
		return runGateway(args[1:], stdout, stderr)
	case "agent":
		return runAgent(args[1:], stdout, stderr)
	case "fake-encoder":
		return runFakeEncoder(args[1:], stdout, stderr)
	case "demo":
		return runDemo(args[1:], stdout, stderr)
	case "version", "--version", "-v":
		bi, _ := debug.ReadBuildInfo() // nil when the binary carries none
		fmt.Fprint(stdout, versionText(version, bi))
		return 0
	case "help", "--help", "-help", "-h":
		if len(args) > 1 && args[1] != "" && args[1][0] != '-' {
			// encgate help COMMAND is COMMAND --help.
			switch args[1] {
			case "gateway", "agent", "fake-encoder", "demo":
				return run([]string{args[1], "--help"}, stdout, stderr)
			}
			fmt.Fprintf(stderr, "unknown command %q\n\n%s", args[1], usage)
			return 2
		}
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "unknown command %q\n\n%s", args[0], usage)
		return 2
	}
}

// newFlagSet is a command's FlagSet whose usage is help followed by the
// description of every flag.
func newFlagSet(name, help string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), help)
		fs.PrintDefaults()
	}
	return fs
}

// parseFlags parses args into fs. -h or --help prints the command's usage
// to stdout and ends the command with exit status 0; any other error (an
// unknown flag, a bad value, a stray argument) prints the error and the
// usage to stderr, exit status 2. ok is true when the command should go on.
func parseFlags(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) (code int, ok bool) {
	var errOut bytes.Buffer
	fs.SetOutput(&errOut)
	err := fs.Parse(args)
	if errors.Is(err, flag.ErrHelp) {
		fs.SetOutput(stdout)
		fs.Usage()
		return 0, false
	}
	fs.SetOutput(stderr)
	if err != nil {
		_, _ = stderr.Write(errOut.Bytes())
		return 2, false
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "unexpected argument %q\n", fs.Arg(0))
		fs.Usage()
		return 2, false
	}
	return 0, true
}

func runDemo(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("demo", demoHelp)
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	if err := demo.Run(context.Background(), stdout, demo.Options{}); err != nil {
		fmt.Fprintln(stderr, "demo:", err)
		return 1
	}
	return 0
}

// versionText is what `encgate version` prints: the version (main.version
// when set with -ldflags, else the main module's version that the go
// command stamped, else "dev"), then, from the build info, the VCS commit
// with its dirty flag and time, and the Go version and platform.
func versionText(ldVersion string, bi *debug.BuildInfo) string {
	v := ldVersion
	if bi != nil && v == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		v = bi.Main.Version
	}
	if v == "" {
		v = "dev"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "encgate %s\n", v)
	if bi == nil {
		fmt.Fprintf(&b, "commit: unknown (no build info)\ngo: %s %s/%s\n", runtime.Version(), runtime.GOOS, runtime.GOARCH)
		return b.String()
	}
	settings := map[string]string{}
	for _, s := range bi.Settings {
		settings[s.Key] = s.Value
	}
	if rev := settings["vcs.revision"]; rev != "" {
		fmt.Fprintf(&b, "commit: %s", rev)
		if settings["vcs.modified"] == "true" {
			b.WriteString(" (dirty)")
		}
		if t := settings["vcs.time"]; t != "" {
			fmt.Fprintf(&b, " %s", t)
		}
		b.WriteString("\n")
	} else {
		b.WriteString("commit: unknown (built without VCS information)\n")
	}
	goos, goarch := settings["GOOS"], settings["GOARCH"]
	if goos == "" {
		goos, goarch = runtime.GOOS, runtime.GOARCH
	}
	goVersion := bi.GoVersion
	if goVersion == "" {
		goVersion = runtime.Version()
	}
	fmt.Fprintf(&b, "go: %s %s/%s\n", goVersion, goos, goarch)
	return b.String()
}

func runGateway(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("gateway", gatewayHelp)
	path := fs.String("config", "", "gateway YAML config `file` (required)")
	check := fs.Bool("check", false, "validate the config, print every problem and the descriptors it can hold open, and exit (0 valid, 2 invalid)")
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	if *path == "" {
		fmt.Fprintln(stderr, "gateway: --config is required")
		return 2
	}
	cfg, err := gateway.LoadConfig(*path)
	if err != nil {
		printProblems(stderr, *path, err)
		return 2
	}
	if *check {
		// What the config can hold open, against this machine's
		// RLIMIT_NOFILE (without raising it: the gateway does at start).
		fds, err := gateway.Descriptors(cfg, nil, false)
		if err != nil {
			printProblems(stderr, *path, err)
			return 2
		}
		fmt.Fprintf(stdout, "%s: valid (%d encoders)\n%s\n", *path, len(cfg.Encoders), fds)
		return 0
	}
	log, level, err := newLogger(cfg.Log.Level, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "gateway:", err)
		return 2
	}
	defer func() { _ = log.Sync() }()
	// go-redis logs through one logger per process (redis.SetLogger), by
	// default plain-text lines on stderr; the process entry is where a
	// global of the process is set, so its lines join this logger's JSON
	// here rather than in a library package. (Tests that run several
	// gateways in one process through run() each install theirs; the last
	// one gets go-redis's lines.)
	redis.SetLogger(redisclient.NewLogger(log))
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	srv, err := gateway.New(cfg, gateway.Deps{Log: log, Registry: reg, Level: &level, Version: version})
	if err != nil {
		log.Error("building gateway", zap.Error(err))
		if _, ok := errors.AsType[*listener.DescriptorError](err); ok {
			return 2 // the config cannot fit RLIMIT_NOFILE: a config error
		}
		return 1
	}
	// Signals are caught from before the listeners open: a SIGHUP sent as
	// soon as /readyz answers must reload, not end the process (SIGHUP's
	// default action), and a SIGTERM then must drain.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sigs)
	if err := srv.Start(); err != nil {
		log.Error("starting gateway", zap.Error(err))
		return 1
	}
	return serveUntilSignal(srv, sigs, *path, cfg, log)
}

// serveUntilSignal reloads the config on SIGHUP (an invalid file is refused
// and the running config stays) and drains on SIGINT/SIGTERM.
func serveUntilSignal(srv *gateway.Server, sigs <-chan os.Signal, path string, cfg gateway.Config, log *zap.Logger) int {
	for draining := false; !draining; {
		select {
		case sig := <-sigs:
			if sig == syscall.SIGHUP {
				reload(srv, path, log)
				continue
			}
			log.Info("signal received, draining", zap.String("signal", sig.String()),
				zap.Duration("delay", cfg.Shutdown.Delay.D()), zap.Duration("grace", cfg.Shutdown.Grace.D()))
			draining = true
		case err := <-srv.Done():
			log.Error("listener stopped", zap.Error(err))
			return 1
		}
	}
	// Not ready at once; the listener closes after shutdown.delay; requests
	// in flight then have shutdown.grace to finish.
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Shutdown.Delay.D()+cfg.Shutdown.Grace.D())
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		log.Error("drain did not finish within shutdown.grace", zap.Error(err))
		return 1
	}
	return 0
}

func runAgent(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("agent", agentHelp)
	path := fs.String("config", "", "agent YAML config `file` (required)")
	check := fs.Bool("check", false, "validate the config, print every problem, and exit (0 valid, 2 invalid)")
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	if *path == "" {
		fmt.Fprintln(stderr, "agent: --config is required")
		return 2
	}
	cfg, err := gpuagent.LoadConfig(*path)
	if err != nil {
		printProblems(stderr, *path, err)
		return 2
	}
	if *check {
		fmt.Fprintf(stdout, "%s: valid\n", *path)
		return 0
	}
	log, _, err := newLogger(cfg.Log.Level, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "agent:", err)
		return 2
	}
	defer func() { _ = log.Sync() }()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	agent, err := gpuagent.New(cfg, gpuagent.Deps{Log: log, Registry: reg})
	if err != nil {
		log.Error("building agent", zap.Error(err))
		return 1
	}
	// Caught from before the listeners open, as the gateway does: a
	// SIGTERM as soon as /readyz answers drains.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	if err := agent.Start(); err != nil {
		log.Error("starting agent", zap.Error(err))
		return 1
	}
	select {
	case sig := <-sigs:
		log.Info("signal received, draining", zap.String("signal", sig.String()), zap.Duration("grace", cfg.Shutdown.Grace.D()))
	case err := <-agent.Done():
		log.Error("listener stopped", zap.Error(err))
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Shutdown.Grace.D())
	defer cancel()
	if err := agent.Shutdown(ctx); err != nil {
		log.Error("drain did not finish within shutdown.grace", zap.Error(err))
		return 1
	}
	return 0
}

func reload(srv *gateway.Server, path string, log *zap.Logger) {
	next, err := gateway.LoadConfig(path)
	if err == nil {
		err = srv.Reload(next)
	} else {
		srv.RefuseReload()
	}
	if err != nil {
		log.Error("config reload refused; the running config stays", zap.String("config", path),
			zap.Strings("problems", problemList(err)))
	}
}

// problemList flattens joined errors into their field-path lines.
func problemList(err error) []string {
	if joined, ok := err.(interface{ Unwrap() []error }); ok {
		var out []string
		for _, e := range joined.Unwrap() {
			out = append(out, problemList(e)...)
		}
		return out
	}
	return []string{err.Error()}
}

func printProblems(w io.Writer, path string, err error) {
	fmt.Fprintf(w, "%s: invalid config\n", path)
	for _, p := range problemList(err) {
		fmt.Fprintf(w, "  %s\n", p)
	}
}

// newLogger is the process's JSON logger, writing to w at level. Its
// entries carry no stack trace below DPanic: what is logged at error (a
// refused reload, an address already in use, a bad config) is an expected
// condition that its message and fields explain, and a stack of the
// process's own main loop would only bury it.
func newLogger(level string, w io.Writer) (*zap.Logger, zap.AtomicLevel, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, zap.AtomicLevel{}, err
	}
	atom := zap.NewAtomicLevelAt(lvl)
	ec := zap.NewProductionEncoderConfig()
	ec.TimeKey = "ts"
	ec.EncodeTime = zapcore.ISO8601TimeEncoder
	out := zapcore.Lock(zapcore.AddSync(w))
	core := zapcore.NewCore(zapcore.NewJSONEncoder(ec), out, atom)
	// zap.NewProduction's sampling: per second and message, the first 100
	// entries, then every 100th.
	core = zapcore.NewSamplerWithOptions(core, time.Second, 100, 100)
	log := zap.New(core, zap.AddCaller(), zap.AddStacktrace(zapcore.DPanicLevel), zap.ErrorOutput(out))
	return log, atom, nil
}

func runFakeEncoder(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("fake-encoder", fakeEncoderHelp)
	listen := fs.String("listen", "127.0.0.1:30000", "listen `address`")
	var opts fakeencoder.Options
	opts.BindFlags(fs)
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	enc := fakeencoder.New(opts)
	if err := enc.Start(*listen); err != nil {
		fmt.Fprintln(stderr, "fake-encoder:", err)
		return 1
	}
	fmt.Fprintf(stderr, "fake encoder %q listening on %s\n", opts.Name, enc.URL())
	// Start began registering with every --register-url; say how that went
	// once each loop has registered or given up.
	stopReport := make(chan struct{})
	reported := make(chan struct{})
	go func() {
		defer close(reported)
		if len(opts.RegisterURLs) == 0 {
			return
		}
		select {
		case <-enc.RegistrationDone():
			s := enc.Stats()
			fmt.Fprintf(stderr, "fake encoder %q registered with %d of %d bootstrap servers (%d attempts)\n",
				opts.Name, s.RegistrationsOK, len(opts.RegisterURLs), s.RegistrationAttempts)
		case <-stopReport:
		}
	}()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	<-sigs
	close(stopReport)
	<-reported
	// Leave the fleets while still serving, as sglang's encoder does at
	// exit; a bootstrap server that is gone is worth a line, not a failure.
	if err := enc.Unregister(context.Background()); err != nil {
		fmt.Fprintln(stderr, "fake-encoder:", err)
	}
	if err := enc.Close(); err != nil {
		fmt.Fprintln(stderr, "fake-encoder:", err)
		return 1
	}
	return 0
}
