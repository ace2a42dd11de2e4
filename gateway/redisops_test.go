package gateway

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// redisOps is a redis.Hook (Deps.RedisHook) that records what a gateway's
// Redis client sends, one entry per round trip: a command is one, a
// pipeline is one whatever it holds. go-redis's Script.Run sends EVALSHA
// and, when the server answers NOSCRIPT (the script's first use on that
// server), EVAL with the whole source: two round trips, both recorded, the
// second counted as a load. A command go-redis retries after a network
// error would be one entry for several round trips; the measurements here
// run on a healthy loopback Redis, where none is retried.
type redisOps struct {
	mu    sync.Mutex
	trips []string // labels of the round trips since the last take, in order
	total int      // round trips since the hook was made (take keeps it)
	cmds  int      // commands in them (a pipeline's all count)
	loads int      // EVALs: a script sent whole
	miss  int      // EVALSHAs answered NOSCRIPT
	dials int
}

var _ redis.Hook = (*redisOps)(nil)

func (h *redisOps) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		h.mu.Lock()
		h.dials++
		h.mu.Unlock()
		return next(ctx, network, addr)
	}
}

func (h *redisOps) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "ping" {
			// The start's check and the /send store's health PING, sent
			// when it has been idle for idempotency.HealthPingInterval:
			// no flow's cost, and on a slow machine one could land in the
			// middle of a measured call.
			return next(ctx, cmd)
		}
		err := next(ctx, cmd)
		h.mu.Lock()
		h.trips = append(h.trips, opLabel(cmd))
		h.total++
		h.cmds++
		switch cmd.Name() {
		case "eval", "eval_ro":
			h.loads++
		case "evalsha", "evalsha_ro":
			// The hook gets the server's error; go-redis sets it on cmd
			// only after the hooks return.
			if err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") {
				h.miss++
			}
		}
		h.mu.Unlock()
		return err
	}
}

func (h *redisOps) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		labels := make([]string, len(cmds))
		for i, c := range cmds {
			labels[i] = opLabel(c)
		}
		h.mu.Lock()
		h.trips = append(h.trips, "pipeline("+strings.Join(labels, ",")+")")
		h.total++
		h.cmds += len(cmds)
		h.mu.Unlock()
		return err
	}
}

// opsTaken is what a redisOps recorded between two takes.
type opsTaken struct {
	trips             []string
	cmds, loads, miss int
	dials             int
}

// rtts is the number of round trips.
func (o opsTaken) rtts() int { return len(o.trips) }

// count is the number of round trips since the hook was made.
func (h *redisOps) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.total
}

// take returns what was recorded since the last take and starts afresh.
func (h *redisOps) take() opsTaken {
	h.mu.Lock()
	defer h.mu.Unlock()
	o := opsTaken{trips: h.trips, cmds: h.cmds, loads: h.loads, miss: h.miss, dials: h.dials}
	h.trips, h.cmds, h.loads, h.miss, h.dials = nil, 0, 0, 0, 0
	return o
}

// opLabel names a command: its name, or for a script the store operation
// it is, told by the kinds of the keys it names (the part after a key's
// hash tag: P{E}:KIND...) and, for the pin script, its op argument.
func opLabel(cmd redis.Cmder) string {
	name := cmd.Name()
	switch name {
	case "evalsha", "eval", "evalsha_ro", "eval_ro":
	default:
		return name
	}
	args := cmd.Args()
	if len(args) < 3 {
		return name
	}
	n, _ := args[2].(int)
	if len(args) < 3+n {
		return name
	}
	kinds := make([]string, n)
	for i := range n {
		k, _ := args[3+i].(string)
		kinds[i] = keyKind(k)
	}
	sig := strings.Join(kinds, ",")
	op := scriptOps[sig]
	switch {
	case op == "pin" && len(args) > 3+n:
		op = fmt.Sprintf("pin %v", args[3+n]) // place, move, encoded, fail
	case op == "":
		op = "script(" + sig + ")"
	}
	if name == "eval" || name == "eval_ro" {
		op += " (EVAL: load)"
	}
	return op
}

// scriptOps names the scripts of the /send store (idempotency/redis.go,
// redis_pending.go) and the shared pins (upstream/pins_redis.go) by the
// kinds of their keys.
var scriptOps = map[string]string{
	"rec,rel":                    "lookup",
	"rec,claim":                  "await",
	"rec,rel,claim,claims,dests": "claim",
	"rec,claim,claims,dests,count,rel,counted": "complete",
	"claim,claims":           "abandon",
	"rec,claim,claims":       "hold",
	"dests,count,rel,claims": "inspect",
	"pin":                    "pin",
}

// keyKind is the part of key after its hash tag's "}:", up to the next ':'
// (P{E}:rec:D is "rec"); a key without a hash tag is itself.
func keyKind(key string) string {
	i := strings.Index(key, "}:")
	if i < 0 {
		return key
	}
	rest := key[i+2:]
	if j := strings.IndexByte(rest, ':'); j >= 0 {
		rest = rest[:j]
	}
	return rest
}
