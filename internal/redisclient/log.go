package redisclient

import (
	"context"
	"fmt"
	"strings"

	"go.uber.org/zap"
)

// Logger carries go-redis's own log lines (a pool's failed dials, a
// Sentinel that did not answer) to a zap logger, so that they come out as
// JSON entries among the gateway's instead of plain "redis: ..." lines on
// stderr. go-redis has one logger per process, not one per client: the
// process entry installs it, once, with redis.SetLogger(NewLogger(log));
// this package keeps no global of its own.
type Logger struct{ log *zap.Logger }

// NewLogger is a Logger writing to log, under the name "redis".
func NewLogger(log *zap.Logger) Logger {
	// The caller shown is go-redis's line that logged: skip this Printf
	// and go-redis's forwarding one.
	return Logger{log: log.Named("redis").WithOptions(zap.AddCallerSkip(2))}
}

// Printf implements go-redis's logging interface. go-redis logs without a
// level, and what it logs is what went wrong (a dial that failed after its
// retries, a connection dropped for unread data): each line is a warning.
func (l Logger) Printf(_ context.Context, format string, v ...any) {
	l.log.Warn(strings.TrimPrefix(fmt.Sprintf(format, v...), "redis: "))
}
