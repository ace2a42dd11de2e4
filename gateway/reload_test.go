package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/secretfile/secretfiletest"
	"github.com/encgate/encgate/upstream"
)

// startGatewayLogged is startGateway with the gateway's log kept for the
// test to read.
func startGatewayLogged(t *testing.T, urls []string, mutate func(*Config)) (*gw, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zapcore.InfoLevel)
	return startGatewayWith(t, urls, mutate, zap.New(core)), logs
}

// nextConfig is a copy of g's live config to change and reload; its
// encoder list is its own.
func nextConfig(g *gw) Config {
	c := *g.conf()
	c.Encoders = slices.Clone(c.Encoders)
	return c
}

// upstreamRows is GET /admin/upstreams.
func upstreamRows(t *testing.T, g *gw) []upstream.EncoderState {
	t.Helper()
	a := do(t, http.MethodGet, g.admin+"/admin/upstreams", "")
	if a.status != 200 {
		t.Fatalf("/admin/upstreams: %d %s", a.status, a.body)
	}
	var rows []upstream.EncoderState
	if err := json.Unmarshal([]byte(a.body), &rows); err != nil {
		t.Fatalf("decoding /admin/upstreams %s: %v", a.body, err)
	}
	return rows
}

// upstreamNames are the encoder names /admin/upstreams lists, in order.
func upstreamNames(t *testing.T, g *gw) []string {
	t.Helper()
	var names []string
	for _, r := range upstreamRows(t, g) {
		names = append(names, r.Name)
	}
	return names
}

// upstreamRow returns /admin/upstreams' row for name.
func upstreamRow(t *testing.T, g *gw, name string) upstream.EncoderState {
	t.Helper()
	for _, r := range upstreamRows(t, g) {
		if r.Name == name {
			return r
		}
	}
	t.Fatalf("/admin/upstreams has no %s", name)
	return upstream.EncoderState{}
}

// hasSeries reports whether the metrics text has a sample of the series
// (name and labels exactly as written, any value).
func hasSeries(text, series string) bool {
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, series+" ") {
			return true
		}
	}
	return false
}

// reloadedLine returns the fields of the single "config reloaded" log line.
func reloadedLine(t *testing.T, logs *observer.ObservedLogs) map[string]any {
	t.Helper()
	lines := logs.FilterMessage("config reloaded").All()
	if len(lines) != 1 {
		t.Fatalf("%d \"config reloaded\" log lines, want 1", len(lines))
	}
	return lines[0].ContextMap()
}

// strs turns a logged zap.Strings field into a []string.
func strs(v any) []string {
	var out []string
	if arr, ok := v.([]any); ok {
		for _, x := range arr {
			out = append(out, fmt.Sprint(x))
		}
	}
	return out
}

func TestReloadAddsAnEncoder(t *testing.T) {
	encs := startFakes(t, 3, nil)
	g, logs := startGatewayLogged(t, fakeURLs(encs)[:2], nil)
	if text := scrape(t, g); hasSeries(text, `encgate_breaker_state{encoder="enc-2"}`) {
		t.Fatalf("enc-2 has a breaker series before it was configured")
	}

	next := nextConfig(g)
	next.Encoders = append(next.Encoders, upstream.EncoderConfig{Name: "enc-2", URL: encs[2].URL()})
	if err := g.Reload(next); err != nil {
		t.Fatalf("Reload: %v", err)
	}

	if got, want := upstreamNames(t, g), []string{"enc-0", "enc-1", "enc-2"}; !slices.Equal(got, want) {
		t.Fatalf("/admin/upstreams lists %v, want %v", got, want)
	}
	rows := upstreamRows(t, g)
	if rows[2].URL != encs[2].URL() || !rows[2].Usable || rows[2].State != "up" {
		t.Fatalf("the new encoder's row: %+v", rows[2])
	}
	wantLines(t, scrape(t, g),
		`encgate_breaker_state{encoder="enc-2"} 0`,
		`encgate_upstream_healthy{encoder="enc-2"} 1`,
		`encgate_config_reloads_total{result="applied"} 1`,
		`encgate_config_reloads_total{result="refused"} 0`,
	)

	// New req_ids whose rendezvous owner is the new encoder go to it.
	for i := 0; i < 5; i++ {
		id := ownedBy(t, g, "enc-2", fmt.Sprintf("added%d", i))
		a := post(t, g.base+"/encode", encodeBody(id))
		if a.status != 200 || a.header.Get("X-Encgate-Encoder") != "enc-2" {
			t.Fatalf("/encode %s: %d encoder=%q %s", id, a.status, a.header.Get("X-Encgate-Encoder"), a.body)
		}
		if n := encs[2].Stats().ReqIDs[id]["/encode"]; n != 1 {
			t.Fatalf("enc-2 received %d /encode for %s, want 1", n, id)
		}
		if m := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id)); m.status != 200 || m.header.Get("X-Encgate-Encoder") != "enc-2" {
			t.Fatalf("metadata %s: %d encoder=%q %s", id, m.status, m.header.Get("X-Encgate-Encoder"), m.body)
		}
	}
	for _, e := range encs[:2] {
		for id := range e.Stats().ReqIDs {
			if strings.HasPrefix(id, "added") {
				t.Errorf("%s received %s, owned by the new encoder", e.Stats().Name, id)
			}
		}
	}

	f := reloadedLine(t, logs)
	if got := strs(f["encoders_added"]); !slices.Equal(got, []string{"enc-2"}) {
		t.Errorf("encoders_added = %v, want [enc-2]", got)
	}
	if got := strs(f["encoders_removed"]); len(got) != 0 {
		t.Errorf("encoders_removed = %v, want none", got)
	}
	if got := strs(f["unchanged_until_restart"]); len(got) != 0 {
		t.Errorf("unchanged_until_restart = %v, want none", got)
	}
}

func TestReloadKeepsPinsOfEncodersThatStay(t *testing.T) {
	// A follow-up sent to an encoder without the req_id's state fails in
	// well under a second instead of waiting sglang's 180s.
	encs := startFakes(t, 3, func(_ int, o *fakeencoder.Options) { o.MetadataTimeout = 200 * time.Millisecond })
	g := startGateway(t, fakeURLs(encs)[:2], nil)
	byName := map[string]*fakeencoder.Encoder{"enc-0": encs[0], "enc-1": encs[1], "enc-2": encs[2]}

	holder := map[string]string{}
	var ids []string
	for i := 0; i < 40; i++ {
		id := fmt.Sprintf("keep-%d_local_part_0", i)
		a := post(t, g.base+"/encode", encodeBody(id))
		if a.status != 200 {
			t.Fatalf("/encode %s: %d %s", id, a.status, a.body)
		}
		holder[id] = a.header.Get("X-Encgate-Encoder")
		ids = append(ids, id)
	}

	rowsBefore := upstreamRows(t, g)
	next := nextConfig(g)
	next.Encoders = append(next.Encoders, upstream.EncoderConfig{Name: "enc-2", URL: encs[2].URL()})
	if err := g.Reload(next); err != nil {
		t.Fatalf("Reload: %v", err)
	}
	// The encoders that stay keep their state: counters and pins.
	rowsAfter := upstreamRows(t, g)
	for i, r := range rowsBefore {
		if a := rowsAfter[i]; a.Name != r.Name || a.Requests != r.Requests || a.Pins != r.Pins || r.Requests == 0 {
			t.Errorf("%s before the reload %+v, after %+v", r.Name, r, a)
		}
	}

	// Some of the earlier req_ids now belong to the new encoder by
	// rendezvous; their pins must still win.
	var moved []string
	for _, id := range ids {
		if e, err := g.Pool().Owner(id); err == nil && e.Name == "enc-2" {
			moved = append(moved, id)
		}
	}
	if len(moved) == 0 {
		t.Fatalf("none of %d req_ids is owned by enc-2 after the reload; use more ids", len(ids))
	}

	for _, id := range ids {
		m := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id))
		if m.status != 200 || m.header.Get("X-Encgate-Encoder") != holder[id] {
			t.Fatalf("metadata %s: %d encoder=%q, want 200 from %s (%s)", id, m.status, m.header.Get("X-Encgate-Encoder"), holder[id], m.body)
		}
		s := post(t, g.base+"/send", sendBody(id, 40000))
		if s.status != 200 || s.header.Get("X-Encgate-Encoder") != holder[id] {
			t.Fatalf("send %s: %d encoder=%q, want 200 from %s (%s)", id, s.status, s.header.Get("X-Encgate-Encoder"), holder[id], s.body)
		}
		st := byName[holder[id]].Stats().ReqIDs[id]
		if st["/encode"] != 1 || st["/scheduler_receive_meta_data"] != 1 || st["/send"] != 1 {
			t.Fatalf("%s saw %v for %s, want one /encode, metadata and /send", holder[id], st, id)
		}
	}
	if got := encs[2].Stats().ReqIDs; len(got) != 0 {
		t.Fatalf("the new encoder received follow-ups of pinned req_ids (%d moved by rendezvous): %v", len(moved), got)
	}
}

// An encoder removed from the file drains: no new /encode, its pinned
// follow-ups still reach it, and it is dropped once its req_ids are
// released.
func TestReloadDrainsARemovedEncoder(t *testing.T) {
	entered := make(chan struct{})
	release := make(chan struct{})
	var once sync.Once
	encs := startFakes(t, 3, func(i int, o *fakeencoder.Options) {
		if i != 1 {
			return
		}
		// Hold the /encode of any "held-" req_id on enc-1 until released.
		o.EncodeHook = func(ctx context.Context, id string) {
			if !strings.HasPrefix(id, "held-") {
				return
			}
			once.Do(func() { close(entered) })
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
	})
	// Every way out of the test releases the held request.
	unblock := sync.OnceFunc(func() { close(release) })
	defer unblock()
	g, logs := startGatewayLogged(t, fakeURLs(encs), nil)

	pinned := ownedBy(t, g, "enc-1", "gone")
	if a := post(t, g.base+"/encode", encodeBody(pinned)); a.status != 200 || a.header.Get("X-Encgate-Encoder") != "enc-1" {
		t.Fatalf("/encode %s: %d encoder=%q %s", pinned, a.status, a.header.Get("X-Encgate-Encoder"), a.body)
	}
	fresh := ownedBy(t, g, "enc-1", "fresh") // enc-1's by rendezvous, never sent before the removal
	stays := ownedBy(t, g, "enc-0", "stays")
	if a := post(t, g.base+"/encode", encodeBody(stays)); a.status != 200 || a.header.Get("X-Encgate-Encoder") != "enc-0" {
		t.Fatalf("/encode %s: %d encoder=%q %s", stays, a.status, a.header.Get("X-Encgate-Encoder"), a.body)
	}
	wantLines(t, scrape(t, g), `encgate_breaker_state{encoder="enc-1"} 0`, `encgate_upstream_healthy{encoder="enc-1"} 1`)

	// An /encode in flight on enc-1 while it is removed.
	held := ownedBy(t, g, "enc-1", "held")
	inflight := make(chan answer, 1)
	go func() {
		a, err := tryDo(http.MethodPost, g.base+"/encode", encodeBody(held))
		if err != nil {
			a = answer{status: -1, body: err.Error()}
		}
		inflight <- a
	}()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the held /encode never reached enc-1")
	}

	next := nextConfig(g)
	next.Encoders = slices.DeleteFunc(next.Encoders, func(e upstream.EncoderConfig) bool { return e.Name == "enc-1" })
	if err := g.Reload(next); err != nil {
		t.Fatalf("Reload: %v", err)
	}
	// The removed encoder drains: still listed, taking no new work.
	if got, want := upstreamNames(t, g), []string{"enc-0", "enc-2", "enc-1"}; !slices.Equal(got, want) {
		t.Fatalf("/admin/upstreams lists %v, want %v", got, want)
	}
	if m := upstreamRow(t, g, "enc-1").Membership; m != "draining" {
		t.Fatalf("enc-1 membership %q after its removal, want draining", m)
	}
	wantLines(t, scrape(t, g), `encgate_fleet_encoders{source="static",state="draining"} 1`,
		`encgate_fleet_encoders{source="static",state="active"} 2`)
	if a := post(t, g.base+"/encode", encodeBody(fresh)); a.status != 200 || a.header.Get("X-Encgate-Encoder") == "enc-1" {
		t.Fatalf("new /encode while enc-1 drains: %d encoder=%q %s", a.status, a.header.Get("X-Encgate-Encoder"), a.body)
	}
	if n := encs[1].Stats().ReqIDs[fresh]["/encode"]; n != 0 {
		t.Fatalf("the draining encoder received %d /encode for a new req_id", n)
	}

	// A follow-up pinned to the removed encoder still reaches it.
	if m := post(t, g.base+"/scheduler_receive_meta_data", metaBody(pinned)); m.status != 200 || m.header.Get("X-Encgate-Encoder") != "enc-1" {
		t.Fatalf("pinned follow-up while enc-1 drains: %d encoder=%q %s", m.status, m.header.Get("X-Encgate-Encoder"), m.body)
	}
	if n := metadataCalls(encs[1], pinned); n != 1 {
		t.Errorf("the draining encoder received %d metadata calls, want 1", n)
	}
	// The pins of an encoder that stays still route there.
	if a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(stays)); a.status != 200 || a.header.Get("X-Encgate-Encoder") != "enc-0" {
		t.Errorf("metadata %s: %d encoder=%q %s", stays, a.status, a.header.Get("X-Encgate-Encoder"), a.body)
	}

	// The request in flight on the removed encoder finishes normally.
	unblock()
	a := <-inflight
	if a.status != 200 || a.header.Get("X-Encgate-Encoder") != "enc-1" {
		t.Fatalf("the in-flight /encode on the removed encoder: %d encoder=%q %s", a.status, a.header.Get("X-Encgate-Encoder"), a.body)
	}
	if n := encs[1].Stats().ReqIDs[held]["/encode"]; n != 1 {
		t.Fatalf("enc-1 received %d /encode for %s", n, held)
	}
	// While pins need it, a drain check keeps it.
	g.fleet.CheckDrained()
	if got := upstreamNames(t, g); !slices.Contains(got, "enc-1") {
		t.Fatalf("enc-1 dropped while pins still need it: %v", got)
	}
	// Its req_ids are released (both /sends of a TP=2 receiver each): the
	// next drain check drops it, and its series go.
	for _, id := range []string{pinned, held} {
		for _, port := range []int{40000, 40001} {
			if s := post(t, g.base+"/send", sendBody(id, port)); s.status != 200 || s.header.Get("X-Encgate-Encoder") != "enc-1" {
				t.Fatalf("send %s:%d while enc-1 drains: %d encoder=%q %s", id, port, s.status, s.header.Get("X-Encgate-Encoder"), s.body)
			}
		}
	}
	g.fleet.CheckDrained()
	if got, want := upstreamNames(t, g), []string{"enc-0", "enc-2"}; !slices.Equal(got, want) {
		t.Fatalf("/admin/upstreams lists %v once enc-1 drained, want %v", got, want)
	}
	text := scrape(t, g)
	for _, series := range []string{`encgate_breaker_state{encoder="enc-1"}`, `encgate_upstream_healthy{encoder="enc-1"}`} {
		if hasSeries(text, series) {
			t.Errorf("metrics still have %s after enc-1 drained", series)
		}
	}
	wantLines(t, text, `encgate_breaker_state{encoder="enc-0"} 0`, `encgate_breaker_state{encoder="enc-2"} 0`,
		`encgate_fleet_encoders{source="static",state="draining"} 0`)

	f := reloadedLine(t, logs)
	if got := strs(f["encoders_draining"]); !slices.Equal(got, []string{"enc-1"}) {
		t.Errorf("encoders_draining = %v, want [enc-1]", got)
	}
	if got := strs(f["encoders_removed"]); len(got) != 0 {
		t.Errorf("encoders_removed = %v at the reload, want none (enc-1 drains first)", got)
	}
	if n := logs.FilterMessage("drained encoders dropped").Len(); n != 1 {
		t.Errorf("%d \"drained encoders dropped\" log lines, want 1", n)
	}
}

func TestReloadRefusesAnInvalidConfig(t *testing.T) {
	encs := startFakes(t, 3, nil)
	g := startGateway(t, fakeURLs(encs)[:2], nil)
	before := g.conf()
	fleet := slices.Clone(g.Pool().Encoders())

	next := nextConfig(g)
	next.Encoders[1].URL = "ftp://x"
	next.Encoders = append(next.Encoders, upstream.EncoderConfig{Name: "enc-2", URL: encs[2].URL()})
	next.Retry.Metadata.MaxAttempts = 0
	err := g.Reload(next)
	if err == nil {
		t.Fatal("Reload accepted an invalid config")
	}
	for _, want := range []string{"encoders[1].url: ", "retry.metadata.max_attempts: "} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not name %q:\n%v", want, err)
		}
	}
	var joined interface{ Unwrap() []error }
	if !errors.As(err, &joined) {
		t.Fatalf("the error is not a list of problems: %v", err)
	}
	for _, p := range joined.Unwrap() {
		if path, _, ok := strings.Cut(p.Error(), ": "); !ok || strings.ContainsAny(path, " \n") {
			t.Errorf("problem %q does not start with a field path", p)
		}
	}

	// Nothing changed.
	if g.conf() != before {
		t.Errorf("the live config changed")
	}
	if got := g.Pool().Encoders(); !slices.Equal(got, fleet) {
		t.Errorf("the fleet changed: %d encoders", len(got))
	}
	rows := upstreamRows(t, g)
	if len(rows) != 2 || rows[0].URL != encs[0].URL() || rows[1].URL != encs[1].URL() {
		t.Errorf("/admin/upstreams after the refusal: %+v", rows)
	}
	text := scrape(t, g)
	wantLines(t, text,
		`encgate_config_reloads_total{result="refused"} 1`,
		`encgate_config_reloads_total{result="applied"} 0`,
	)
	if hasSeries(text, `encgate_breaker_state{encoder="enc-2"}`) {
		t.Errorf("the refused config's encoder has a breaker series")
	}
	// The old retry policy still applies, and enc-1 is still served.
	id := ownedBy(t, g, "enc-1", "after-refusal")
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 || a.header.Get("X-Encgate-Encoder") != "enc-1" {
		t.Fatalf("/encode after the refusal: %d encoder=%q %s", a.status, a.header.Get("X-Encgate-Encoder"), a.body)
	}
	if a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id)); a.status != 200 {
		t.Fatalf("metadata after the refusal: %d %s", a.status, a.body)
	}
}

func TestReloadKeepsRestartOnlySettings(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g, logs := startGatewayLogged(t, fakeURLs(encs), func(c *Config) {
		c.Limits.MaxBodyBytes = 64 << 10
	})
	before := *g.conf()

	next := nextConfig(g)
	next.Listen, next.AdminListen = "127.0.0.1:1", "127.0.0.1:2"
	next.Limits.MaxBodyBytes = 8 << 20
	next.Affinity.UnknownWait = configfile.Duration(time.Second)
	next.Idempotency.TTL = configfile.Duration(time.Minute)
	next.Shutdown.Grace = configfile.Duration(time.Second)
	next.Retry.Metadata.MaxAttempts = 3 // applies at once
	if err := g.Reload(next); err != nil {
		t.Fatalf("Reload: %v", err)
	}

	live := g.conf()
	if live.Listen != before.Listen || live.AdminListen != before.AdminListen || live.Limits != before.Limits ||
		live.Affinity != before.Affinity || live.Idempotency != before.Idempotency || live.Shutdown != before.Shutdown {
		t.Errorf("restart-only settings changed: %+v", live)
	}
	if live.Retry.Metadata.MaxAttempts != 3 {
		t.Errorf("the retry policy in the same reload was not applied")
	}
	wantLines(t, scrape(t, g), `encgate_config_reloads_total{result="applied"} 1`)

	// Still serving on the same address, with the old body limit.
	big := `{"req_id":"big_local_part_0","mm_items":["` + strings.Repeat("x", 100<<10) + `"]}`
	wantEnvelopeMsg(t, post(t, g.base+"/encode", big), 413,
		"encgate: request body exceeds limits.max_body_bytes (64KiB)", nil)
	if n := encs[0].Stats().Routes["/encode"]; n != 0 {
		t.Fatalf("the oversized body reached the encoder (%d)", n)
	}
	if a := post(t, g.base+"/encode", encodeBody("small_local_part_0")); a.status != 200 {
		t.Fatalf("/encode after the reload: %d %s", a.status, a.body)
	}

	f := reloadedLine(t, logs)
	want := []string{"listen", "admin_listen", "affinity", "idempotency", "limits.max_body_bytes", "shutdown"}
	if got := strs(f["unchanged_until_restart"]); !slices.Equal(got, want) {
		t.Errorf("unchanged_until_restart = %v, want %v", got, want)
	}
}

func TestReloadAppliesTheRetryPolicy(t *testing.T) {
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) { o.Faults.Leading504s = 5 })
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Retry.Metadata.MaxAttempts = 6 })

	const first = "policy-6_local_part_0"
	post(t, g.base+"/encode", encodeBody(first))
	if a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(first)); a.status != 200 || a.header.Get("X-Encgate-Attempts") != "6" {
		t.Fatalf("before the reload: %d attempts=%q %s", a.status, a.header.Get("X-Encgate-Attempts"), a.body)
	}

	next := nextConfig(g)
	next.Retry.Metadata.MaxAttempts = 1
	if err := g.Reload(next); err != nil {
		t.Fatalf("Reload: %v", err)
	}

	const second = "policy-1_local_part_0"
	post(t, g.base+"/encode", encodeBody(second))
	a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(second))
	want := `{"status":"error","message":"encode metadata not ready","req_id":"policy-1_local_part_0"}`
	if a.status != 504 || a.body != want || a.header.Get("X-Encgate-Attempts") != "1" {
		t.Fatalf("after the reload: %d attempts=%q %s", a.status, a.header.Get("X-Encgate-Attempts"), a.body)
	}
	if n := metadataCalls(encs[0], second); n != 1 {
		t.Fatalf("the encoder got %d metadata calls, want 1", n)
	}
}

// A name moved to another URL leaves its staged state behind: its pins
// fail fast instead of sending follow-ups to a machine that never saw the
// /encode, and the reload reports it as removed and added.
func TestReloadMovingAnEncoderFailsItsPinsFast(t *testing.T) {
	encs := startFakes(t, 2, nil)
	g, logs := startGatewayLogged(t, fakeURLs(encs[:1]), nil)
	const id = "moved_local_part_0"
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
		t.Fatalf("encode %d", a.status)
	}
	next := nextConfig(g)
	next.Encoders[0].URL = encs[1].URL()
	if err := g.Reload(next); err != nil {
		t.Fatal(err)
	}
	line := reloadedLine(t, logs)
	if !slices.Equal(strs(line["encoders_added"]), []string{"enc-0"}) || !slices.Equal(strs(line["encoders_removed"]), []string{"enc-0"}) {
		t.Fatalf("reload log %v", line)
	}
	a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id))
	if a.status != 503 || !strings.Contains(a.body, `encoder \"enc-0\" holding this req_id is no longer configured`) {
		t.Fatalf("follow-up of a moved encoder: %d %s", a.status, a.body)
	}
	if n := encs[1].Stats().Routes["/scheduler_receive_meta_data"]; n != 0 {
		t.Fatalf("the new machine got %d metadata pulls for a part it never encoded", n)
	}
	// New work goes to the new URL.
	if b := post(t, g.base+"/encode", encodeBody("fresh_local_part_0")); b.status != 200 || encs[1].Stats().Routes["/encode"] != 1 {
		t.Fatalf("new /encode after the move: %d", b.status)
	}
}

// admin.token_file is read at start and again on every reload: after the
// file is rewritten (a rotated Secret) and the config reloaded unchanged,
// the old token is refused and the new one accepted on /admin/.... A
// reload whose file turned unreadable is refused and the token in force
// stays. The status page names the file, never the token.
func TestAdminTokenFileIsReadAgainOnReload(t *testing.T) {
	const first, second = "admin-token-first-0123456", "admin-token-second-0123456"
	file := secretfiletest.Write(t, "admin.token", first+"\n", 0o600)
	g := startGateway(t, fakeURLs(startFakes(t, 1, nil)), func(c *Config) { c.Admin.TokenFile = file })
	get := func(token string) answer {
		t.Helper()
		return doWith(t, http.MethodGet, g.admin+"/admin/upstreams", "", http.Header{"Authorization": {"Bearer " + token}})
	}
	refused := func(token string) {
		t.Helper()
		a := get(token)
		wantEnvelopeMsg(t, a, http.StatusUnauthorized, "encgate: the bearer token is not admin.token", nil)
		if got := a.header.Get("WWW-Authenticate"); !strings.Contains(got, `error="invalid_token"`) {
			t.Errorf("WWW-Authenticate %q", got)
		}
	}
	if a := do(t, http.MethodGet, g.admin+"/admin/upstreams", ""); a.status != http.StatusUnauthorized {
		t.Fatalf("/admin/upstreams without a token: %d", a.status)
	}
	if a := get(first); a.status != 200 {
		t.Fatalf("the file's token: %d %s", a.status, a.body)
	}

	if err := os.WriteFile(file, []byte(second+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	refused(second) // not before the reload
	if err := g.Reload(nextConfig(g)); err != nil {
		t.Fatalf("Reload: %v", err)
	}
	refused(first)
	if a := get(second); a.status != 200 {
		t.Fatalf("the rewritten file's token after the reload: %d %s", a.status, a.body)
	}

	if err := os.Chmod(file, 0o644); err != nil {
		t.Fatal(err)
	}
	err := g.Reload(nextConfig(g))
	if err == nil || !strings.Contains(err.Error(), "admin.token_file: token file "+file+" has mode 0644") {
		t.Fatalf("Reload of an open token file = %v", err)
	}
	if a := get(second); a.status != 200 {
		t.Fatalf("the token in force after the refused reload: %d %s", a.status, a.body)
	}
	wantLines(t, scrape(t, g), `encgate_config_reloads_total{result="refused"} 1`, `encgate_config_reloads_total{result="applied"} 1`)

	status := doWith(t, http.MethodGet, g.admin+"/", "", http.Header{"Authorization": {"Bearer " + second}})
	if status.status != 200 || !strings.Contains(status.body, "set from admin.token_file "+file+" (not shown)") {
		t.Errorf("the status page: %d, want the token file named:\n%s", status.status, status.body)
	}
	for _, tok := range []string{first, second} {
		if strings.Contains(status.body, tok) || strings.Contains(err.Error(), tok) {
			t.Errorf("the status page or the refusal shows a token")
		}
	}
}
