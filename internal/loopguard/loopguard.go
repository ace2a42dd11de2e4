// Package loopguard is the gateway's hop mark: the Via entry on every
// request it forwards, and the check that ends a request that looped back
// to it (Guard).
package loopguard

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
)

// Guard ends what the address checks (fleet/selfguard.go) cannot see: an
// encoder URL that reaches the gateway through NAT or a Service in front of
// it, or a second gateway whose fleet leads back to this one.
//
// Every request the gateway forwards (to an encoder or its agent: /encode,
// metadata pulls, registrations, /send, the profile broadcast) carries a
// Via header (RFC 9110 §7.6.3): the Via it arrived with, if any, with this
// gateway's entry "1.1 encgate-<id>" appended, <id> being random per
// process. Via rather than a header of its own: it is the standard field
// for exactly this, proxies in between (a mesh sidecar, an ingress) keep it
// and append their own entries, so a loop through them is seen and counted
// too, and sglang's encoders ignore it. The received-by of the entry is a
// pseudonym (a token: "encgate-<id>"; RFC 9110 allows a pseudonym where
// the host should stay unnamed), so the gateway's address is not exposed.
//
// A request that arrives carrying this gateway's own entry has looped: it
// is answered 508 Loop Detected at once (the gateway's JSON envelope), and
// nothing is forwarded. So is a request whose Via lists more than
// self_guard.max_hops entries, so that a loop through gateways that never
// see their own mark (a chain longer than any one's view) also ends. Both
// count in encgate_loops_detected_total{reason}. The routes the gateway
// answers itself (/health, /health_generate, unknown paths) forward
// nothing and are not checked.
type Guard struct {
	id       string // random per process, hex
	mark     string // the received-by of this gateway's entry: "encgate-<id>"
	entry    []byte // this gateway's entry: "1.1 encgate-<id>"
	detected *prometheus.CounterVec
}

// Reasons of encgate_loops_detected_total.
const (
	OwnMark = "own_mark"
	MaxHops = "max_hops"
)

// New draws the instance id from entropy (nil: crypto/rand).
func New(entropy io.Reader, reg prometheus.Registerer) (*Guard, error) {
	if entropy == nil {
		entropy = rand.Reader
	}
	var b [8]byte
	if _, err := io.ReadFull(entropy, b[:]); err != nil {
		return nil, fmt.Errorf("drawing the gateway's instance id: %w", err)
	}
	id := hex.EncodeToString(b[:])
	l := &Guard{id: id, mark: "encgate-" + id, entry: []byte("1.1 encgate-" + id),
		detected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_loops_detected_total",
			Help: "Requests answered 508 Loop Detected and not forwarded, by reason: own_mark (the request had passed this gateway already: its Via carries this gateway's entry) or max_hops (its Via lists more than self_guard.max_hops proxies).",
		}, []string{"reason"}),
	}
	for _, r := range []string{OwnMark, MaxHops} {
		l.detected.WithLabelValues(r)
	}
	if reg != nil {
		reg.MustRegister(l.detected)
	}
	return l, nil
}

// Read counts the entries of every Via field of h and reports whether
// one is this gateway's. Entries are separated by commas outside comments
// (parentheses, which may hold commas); an entry is "protocol received-by
// [comment]", and this gateway's has its mark as received-by.
func (l *Guard) Read(h *fasthttp.RequestHeader) (hops int, own bool) {
	for _, v := range h.PeekAll(fasthttp.HeaderVia) {
		start, depth := 0, 0
		for i := 0; i <= len(v); i++ {
			if i < len(v) {
				switch v[i] {
				case '(':
					depth++
					continue
				case ')':
					if depth > 0 {
						depth--
					}
					continue
				case ',':
					if depth > 0 {
						continue
					}
				default:
					continue
				}
			}
			if e := v[start:i]; !blank(e) {
				hops++
				own = own || l.isMine(e)
			}
			start = i + 1
		}
	}
	return hops, own
}

// isMine reports whether the Via entry e's received-by is this gateway's
// mark.
func (l *Guard) isMine(e []byte) bool {
	// protocol, whitespace, received-by, then whitespace or the end.
	i := 0
	for i < len(e) && isSpace(e[i]) {
		i++
	}
	for i < len(e) && !isSpace(e[i]) {
		i++
	}
	for i < len(e) && isSpace(e[i]) {
		i++
	}
	j := i
	for j < len(e) && !isSpace(e[j]) && e[j] != '(' {
		j++
	}
	return string(e[i:j]) == l.mark
}

func isSpace(b byte) bool { return b == ' ' || b == '\t' }

func blank(b []byte) bool {
	for _, c := range b {
		if !isSpace(c) {
			return false
		}
	}
	return true
}

// Via is the Via a request forwarded for the one in h carries: what it
// arrived with, then this gateway's entry. Without a Via it is the entry
// itself (shared: the caller must not change it).
func (l *Guard) Via(h *fasthttp.RequestHeader) []byte {
	in := h.PeekAll(fasthttp.HeaderVia)
	if len(in) == 0 {
		return l.entry
	}
	n := len(l.entry)
	for _, v := range in {
		n += len(v) + 2
	}
	out := make([]byte, 0, n)
	for _, v := range in {
		out = append(out, v...)
		out = append(out, ", "...)
	}
	return append(out, l.entry...)
}

// Mark is the received-by of this gateway's Via entry: "encgate-<id>".
func (l *Guard) Mark() string { return l.mark }

// Entry is this gateway's Via entry (shared: the caller must not change it).
func (l *Guard) Entry() []byte { return l.entry }

// Detected counts a request refused as a loop, by reason (OwnMark or
// MaxHops).
func (l *Guard) Detected(reason string) { l.detected.WithLabelValues(reason).Inc() }
