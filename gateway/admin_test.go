package gateway

import (
	"github.com/encgate/encgate/upstream"

	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/encgate/encgate/fakeencoder"
)

// scrape returns the admin listener's /metrics text.
func scrape(t *testing.T, g *gw) string {
	t.Helper()
	a := do(t, http.MethodGet, g.admin+"/metrics", "")
	if a.status != 200 {
		t.Fatalf("GET /metrics: %d %s", a.status, a.body)
	}
	return a.body
}

func wantLines(t *testing.T, text string, lines ...string) {
	t.Helper()
	for _, l := range lines {
		if !hasLine(text, l) {
			t.Errorf("metrics lack the line %q", l)
		}
	}
}

func TestMetrics(t *testing.T) {
	encs := startFakes(t, 1, nil)
	// One attempt: the gateway's own 502 for the dead encoder is what is measured.
	g := startGateway(t, []string{encs[0].URL(), "http://" + deadAddr(t)}, func(c *Config) { c.Retry.Encode.MaxAttempts = 1 })
	okID := ownedBy(t, g, "enc-0", "m-ok")
	if a := post(t, g.base+"/encode", encodeBody(okID)); a.status != 200 {
		t.Fatalf("/encode: %d %s", a.status, a.body)
	}
	text := scrape(t, g)
	wantLines(t, text,
		`encgate_requests_total{code="200",route="encode"} 1`,
		`encgate_request_duration_seconds_count{route="encode"} 1`,
		`encgate_upstream_requests_total{code="200",encoder="enc-0",route="encode"} 1`,
		`encgate_pins 1`,
	)
	// Every route's histogram exists from the start.
	wantLines(t, text, `encgate_request_duration_seconds_count{route="send"} 0`)

	deadID := ownedBy(t, g, "enc-1", "m-dead")
	if a := post(t, g.base+"/encode", encodeBody(deadID)); a.status != 502 {
		t.Fatalf("/encode to the dead encoder: %d %s", a.status, a.body)
	}
	text = scrape(t, g)
	wantLines(t, text,
		`encgate_requests_total{code="502",route="encode"} 1`,
		`encgate_upstream_requests_total{code="dial_error",encoder="enc-1",route="encode"} 1`,
		`encgate_request_duration_seconds_count{route="encode"} 2`,
	)
	for _, id := range []string{okID, deadID} {
		if strings.Contains(text, id) {
			t.Errorf("metrics carry the req_id %q as a label", id)
		}
	}
	if strings.Contains(text, g.Pool().Encoders()[1].URL) {
		t.Errorf("metrics carry an encoder URL")
	}
}

func TestAdminHealthReadyAndUpstreams(t *testing.T) {
	encs := startFakes(t, 2, nil)
	g := startGateway(t, fakeURLs(encs), nil)
	if a := do(t, http.MethodGet, g.admin+"/healthz", ""); a.status != 200 || a.body != "ok\n" {
		t.Fatalf("/healthz: %d %q", a.status, a.body)
	}
	if a := do(t, http.MethodGet, g.admin+"/readyz", ""); a.status != 200 || a.body != "ready\n" {
		t.Fatalf("/readyz: %d %q", a.status, a.body)
	}
	// The admin routes live only on the admin listener.
	if a := do(t, http.MethodGet, g.base+"/admin/upstreams", ""); a.status != 404 {
		t.Fatalf("/admin/upstreams on the encoder-facing listener: %d", a.status)
	}

	want := map[string]int{}
	for _, id := range []string{"u0", "u1", "u2", "u3", "u4", "u5", "u6", "u7"} {
		a := post(t, g.base+"/encode", encodeBody(id))
		if a.status != 200 {
			t.Fatalf("/encode %s: %d %s", id, a.status, a.body)
		}
		want[a.header.Get("X-Encgate-Encoder")]++
	}
	if len(want) != 2 {
		t.Fatalf("all /encodes went to %v; pick ids that spread", want)
	}
	g.Pool().Encoders()[1].SetUsable(false)

	a := do(t, http.MethodGet, g.admin+"/admin/upstreams", "")
	if a.status != 200 || a.header.Get("Content-Type") != "application/json" {
		t.Fatalf("/admin/upstreams: %d %q %s", a.status, a.header.Get("Content-Type"), a.body)
	}
	dec := json.NewDecoder(strings.NewReader(a.body))
	dec.DisallowUnknownFields()
	var got []upstream.EncoderState
	if err := dec.Decode(&got); err != nil {
		t.Fatalf("decoding %s: %v", a.body, err)
	}
	wantRows := []upstream.EncoderState{
		{Name: "enc-0", URL: encs[0].URL(), Source: "static", Membership: "active", Usable: true, Requests: uint64(want["enc-0"]), Pins: want["enc-0"]},
		{Name: "enc-1", URL: encs[1].URL(), Source: "static", Membership: "active", Usable: false, Requests: uint64(want["enc-1"]), Pins: want["enc-1"]},
	}
	if len(got) != len(wantRows) {
		t.Fatalf("got %d rows, want %d: %s", len(got), len(wantRows), a.body)
	}
	wantRows[0].State, wantRows[1].State = "up", "disabled"
	for i := range wantRows {
		got[i].Breaker, got[i].Health = upstream.BreakerView{}, upstream.HealthSnapshot{} // checked below
		if got[i] != wantRows[i] {
			t.Errorf("row %d = %+v, want %+v", i, got[i], wantRows[i])
		}
	}
	var raw []struct {
		Breaker upstream.BreakerView    `json:"breaker"`
		Health  upstream.HealthSnapshot `json:"health"`
	}
	if err := json.Unmarshal([]byte(a.body), &raw); err != nil {
		t.Fatal(err)
	}
	for i, r := range raw {
		if r.Breaker.State != "closed" || r.Breaker.TotalFailures != 0 || !r.Health.Up {
			t.Errorf("row %d passive/active state %+v %+v", i, r.Breaker, r.Health)
		}
	}
}

var startLine = regexp.MustCompile(`^Start profiling\. output_dir=(\S+) profile_id=\S+$`)

// profileLines splits a broadcast answer into its per-encoder lines and
// checks the joined shape: "name: text" lines, "\n"-joined, trailing "\n".
func profileLines(t *testing.T, a answer) map[string]string {
	t.Helper()
	if got := a.header.Get("Content-Type"); got != "text/plain; charset=utf-8" {
		t.Fatalf("Content-Type %q (body %q)", got, a.body)
	}
	if !strings.HasSuffix(a.body, "\n") || strings.HasSuffix(a.body, "\n\n") {
		t.Fatalf("body %q does not end in exactly one newline", a.body)
	}
	out := map[string]string{}
	var names []string
	for _, l := range strings.Split(strings.TrimSuffix(a.body, "\n"), "\n") {
		name, text, ok := strings.Cut(l, ": ")
		if !ok {
			t.Fatalf("line %q is not \"name: text\" (body %q)", l, a.body)
		}
		out[name] = text
		names = append(names, name)
	}
	if strings.Join(names, ",") != "enc-0,enc-1" {
		t.Fatalf("lines for %v, want enc-0 then enc-1 (body %q)", names, a.body)
	}
	return out
}

func TestProfileBroadcast(t *testing.T) {
	encs := startFakes(t, 2, nil)
	g := startGateway(t, fakeURLs(encs), nil)

	a := post(t, g.base+"/start_profile", `{"output_dir":"/tmp/prof"}`)
	if a.status != 200 {
		t.Fatalf("start: %d %q", a.status, a.body)
	}
	for name, text := range profileLines(t, a) {
		m := startLine.FindStringSubmatch(text)
		if m == nil || m[1] != "/tmp/prof" {
			t.Errorf("%s: %q, want a start with the forwarded output_dir", name, text)
		}
	}

	a = do(t, http.MethodGet, g.base+"/start_profile", "")
	if a.status != 400 {
		t.Fatalf("second start: %d %q, want 400", a.status, a.body)
	}
	for name, text := range profileLines(t, a) {
		if text != "profiling already running" {
			t.Errorf("%s: %q", name, text)
		}
	}

	a = do(t, http.MethodGet, g.base+"/stop_profile", "")
	if a.status != 200 || a.body != "enc-0: Stop profiling.\nenc-1: Stop profiling.\n" {
		t.Fatalf("stop: %d %q", a.status, a.body)
	}

	// One encoder failing makes the whole answer fail: start enc-1 behind
	// the gateway's back, then start through the gateway.
	resp, err := client.Post(encs[1].URL()+"/start_profile", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	a = do(t, http.MethodGet, g.base+"/start_profile", "")
	if a.status != 400 {
		t.Fatalf("start with enc-1 already running: %d %q, want 400", a.status, a.body)
	}
	lines := profileLines(t, a)
	if !startLine.MatchString(lines["enc-0"]) || lines["enc-1"] != "profiling already running" {
		t.Fatalf("lines %q", lines)
	}
	if seen := routesSeen(encs); seen["/start_profile"] != 7 || seen["/stop_profile"] != 2 {
		t.Fatalf("encoders received %v", seen)
	}
}

func TestProfileBroadcastWithADeadEncoder(t *testing.T) {
	encs := startFakes(t, 1, nil)
	dead := "http://" + deadAddr(t)
	g := startGateway(t, []string{encs[0].URL(), dead}, nil)

	a := do(t, http.MethodGet, g.base+"/start_profile", "")
	if a.status != 502 {
		t.Fatalf("start: %d %q, want 502", a.status, a.body)
	}
	lines := profileLines(t, a)
	if !startLine.MatchString(lines["enc-0"]) {
		t.Errorf("enc-0: %q", lines["enc-0"])
	}
	for _, part := range []string{"cannot connect to encoder enc-1", dead} {
		if !strings.Contains(lines["enc-1"], part) {
			t.Errorf("enc-1: %q does not contain %q", lines["enc-1"], part)
		}
	}
	// 400 from the live encoder and 502 from the dead one: the highest wins.
	a = do(t, http.MethodGet, g.base+"/start_profile", "")
	if a.status != 502 {
		t.Fatalf("second start: %d %q, want 502", a.status, a.body)
	}
	if lines := profileLines(t, a); lines["enc-0"] != "profiling already running" {
		t.Errorf("enc-0: %q", lines["enc-0"])
	}
	wantLines(t, scrape(t, g),
		`encgate_upstream_requests_total{code="dial_error",encoder="enc-1",route="profile"} 2`,
		`encgate_upstream_requests_total{code="400",encoder="enc-0",route="profile"} 1`,
		`encgate_requests_total{code="502",route="profile"} 2`,
	)
}

// tryDo is do for goroutines other than the test's: it reports errors
// instead of failing the test.
func tryDo(method, url, body string) (answer, error) {
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, resp.Header, string(b)}, err
}

func TestShutdownDrainsInFlightRequests(t *testing.T) {
	arrived := make(chan string, 1)
	release := make(chan struct{})
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) {
		o.EncodeHook = func(ctx context.Context, reqID string) {
			arrived <- reqID
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
	})
	g := startGateway(t, fakeURLs(encs), nil)
	var once sync.Once
	releaseHook := func() { once.Do(func() { close(release) }) }
	t.Cleanup(releaseHook) // runs before the gateway's own cleanup if the test fails early
	const id = "drain_local_part_0"

	type result struct {
		a   answer
		err error
	}
	inflight := make(chan result, 1)
	go func() {
		a, err := tryDo(http.MethodPost, g.base+"/encode", encodeBody(id))
		inflight <- result{a, err}
	}()
	if got := <-arrived; got != id {
		t.Fatalf("encoder holds %q", got)
	}

	shut := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		shut <- g.Shutdown(ctx)
	}()
	eventually(t, "/readyz to report not ready", func() bool {
		a, err := tryDo(http.MethodGet, g.admin+"/readyz", "")
		return err != nil || a.status == http.StatusServiceUnavailable
	})
	eventually(t, "the encoder-facing listener to close", func() bool {
		c, err := net.Dial("tcp", g.Addr())
		if err != nil {
			return true
		}
		c.Close()
		return false
	})
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned (%v) while a request was in flight", err)
	case r := <-inflight:
		t.Fatalf("the in-flight /encode ended before its encoder answered: %+v", r)
	default:
	}

	releaseHook()
	r := <-inflight
	if r.err != nil {
		t.Fatalf("in-flight /encode: %v", r.err)
	}
	if r.a.status != 200 || !strings.Contains(r.a.body, `"req_id":"`+id+`"`) {
		t.Fatalf("in-flight /encode: %d %s", r.a.status, r.a.body)
	}
	select {
	case err := <-shut:
		if err != nil {
			t.Fatalf("Shutdown: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Shutdown did not return after the last request finished")
	}
	if _, err := tryDo(http.MethodGet, g.admin+"/healthz", ""); err == nil {
		t.Error("the admin listener still answers after Shutdown")
	}
}
