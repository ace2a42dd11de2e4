package redisclient

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/logging"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// closedAddr is a loopback address nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

// pingClosed makes go-redis log: its pool's dial to a closed port fails
// after its one attempt, and it says so through its process-wide logger.
func pingClosed(t *testing.T) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: closedAddr(t), DialerRetries: 1, MaxRetries: -1})
	defer func() { _ = c.Close() }()
	if err := c.Ping(context.Background()).Err(); err == nil {
		t.Fatal("PING to a closed port succeeded")
	}
}

// A go-redis log line arrives as a zap entry, at warn, named "redis".
func TestLoggerCarriesGoRedisLines(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	redis.SetLogger(NewLogger(zap.New(core)))
	t.Cleanup(enableDefaultRedisLog)
	pingClosed(t)
	entries := logs.FilterMessageSnippet("failed to dial").All()
	if len(entries) == 0 {
		t.Fatalf("no go-redis dial failure among the zap entries: %v", logs.All())
	}
	e := entries[0]
	if e.Level != zapcore.WarnLevel || e.LoggerName != "redis" || strings.HasPrefix(e.Message, "redis: ") {
		t.Fatalf("entry %+v: want level warn, logger redis, no \"redis: \" prefix", e)
	}
	if !strings.Contains(e.Message, "connection refused") {
		t.Errorf("entry %q does not say why the dial failed", e.Message)
	}
}

// In a process of its own (go-redis's logger is process-wide, and so is
// stderr), nothing of go-redis's reaches stderr once the Logger is
// installed: the dial failure is a JSON line on the zap logger's output.
// Without it, the same failure is a plain-text line on stderr, which is
// what this guards against.
func TestGoRedisWritesNothingToStderr(t *testing.T) {
	if mode := os.Getenv("REDISCLIENT_LOG_CHILD"); mode != "" {
		if mode == "zap" {
			log := zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.Lock(os.Stdout), zapcore.DebugLevel), zap.AddCaller())
			redis.SetLogger(NewLogger(log))
		}
		pingClosed(t)
		return
	}
	for _, mode := range []string{"zap", "default"} {
		t.Run(mode, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestGoRedisWritesNothingToStderr$", "-test.count=1")
			cmd.Env = append(os.Environ(), "REDISCLIENT_LOG_CHILD="+mode)
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			if err := cmd.Run(); err != nil {
				t.Fatalf("child: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
			}
			switch mode {
			case "zap":
				if stderr.Len() != 0 {
					t.Errorf("go-redis wrote to stderr:\n%s", stderr.String())
				}
				if !strings.Contains(stdout.String(), `{"level":"warn"`) || !strings.Contains(stdout.String(), `"caller":"pool/pool.go:`) ||
					!strings.Contains(stdout.String(), "failed to dial") {
					t.Errorf("no zap JSON entry for the dial failure in:\n%s", stdout.String())
				}
			case "default":
				if !strings.Contains(stderr.String(), "redis: ") || !strings.Contains(stderr.String(), "failed to dial") {
					t.Errorf("go-redis's default logger wrote no plain line to stderr (the test above would prove nothing):\n%s", stderr.String())
				}
			}
		})
	}
}

// enableDefaultRedisLog puts go-redis's own stderr logger back.
func enableDefaultRedisLog() { logging.Enable() }
