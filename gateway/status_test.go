package gateway

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/upstream"
)

// The status page shows each encoder, an open breaker as open, the
// duplicate-suppression counter as /metrics has it, the gateway's own
// latest failure answers (escaped: a req_id is a caller's text), and the
// reloadable config without the admin token; it needs the admin token.
func TestStatusPageShowsTheFleetAndIsProtected(t *testing.T) {
	encs := startFakes(t, 2, func(i int, o *fakeencoder.Options) {
		if i == 1 {
			o.Faults = fakeencoder.Faults{FailureRate: 1, FailRoutes: []string{"/encode"}}
		}
	})
	const token = "status-page-token-0123456789"
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Breaker.ConsecutiveFailures = 1
		c.Admin.Token = token
		c.Affinity.UnknownWait = 0
	})
	auth := http.Header{"Authorization": {"Bearer " + token}}
	// enc-1 fails an /encode: its breaker opens.
	bad := ownedBy(t, g, "enc-1", `x<script>alert(1)</script>`)
	if a := post(t, g.base+"/encode", encodeBody(bad)); a.status == 200 {
		t.Fatalf("/encode on the failing encoder: %d %s", a.status, a.body)
	}
	// A duplicate /send is suppressed.
	ok := ownedBy(t, g, "enc-0", "fine")
	if a := post(t, g.base+"/encode", encodeBody(ok)); a.status != 200 {
		t.Fatalf("/encode: %d %s", a.status, a.body)
	}
	for i := 0; i < 2; i++ {
		if a := post(t, g.base+"/send", sendBody(ok, 40000)); a.status != 200 {
			t.Fatalf("/send: %d %s", a.status, a.body)
		}
	}
	// A follow-up of the failed part is answered by the gateway itself.
	if a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(bad)); a.status == 200 {
		t.Fatalf("follow-up of a failed /encode: %d", a.status)
	}

	if a := do(t, http.MethodGet, g.admin+"/", ""); a.status != http.StatusUnauthorized {
		t.Fatalf("GET / without the admin token: %d, want 401", a.status)
	}
	a := doWith(t, http.MethodGet, g.admin+"/", "", auth)
	if a.status != 200 || !strings.HasPrefix(a.header.Get("Content-Type"), "text/html") {
		t.Fatalf("GET /: %d %s", a.status, a.header.Get("Content-Type"))
	}
	page := a.body
	for _, want := range []string{`data-encoder="enc-0"`, `data-encoder="enc-1"`, encs[0].URL(),
		`<meta http-equiv="refresh"`, `breaker open">open</span>`, `breaker closed">closed</span>`,
		`breaker open">open</span> <span class="muted">(ejected: trip 1, for 30s, until `,
		`breaker closed">closed</span> <span class="muted">(0 failures in a row)`} {
		if !strings.Contains(page, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	if strings.Contains(page, "<script>") || !strings.Contains(page, "x&lt;script&gt;alert(1)&lt;/script&gt;") {
		t.Errorf("a caller's req_id is not escaped on the page")
	}
	if strings.Contains(page, token) {
		t.Error("the page shows the admin token")
	}
	if strings.Contains(page, "http://") && strings.Contains(page, "src=") {
		t.Error("the page loads something from elsewhere")
	}
	// The counter the page shows is the one /metrics has.
	m := doWith(t, http.MethodGet, g.admin+"/metrics", "", auth).body
	var line string
	for _, l := range strings.Split(m, "\n") {
		if strings.HasPrefix(l, "encgate_send_duplicates_suppressed_total{") && !strings.HasSuffix(l, " 0") {
			line = l
		}
	}
	if line == "" {
		t.Fatalf("/metrics counts no suppressed duplicate:\n%s", m)
	}
	labels := line[strings.Index(line, "{")+1 : strings.Index(line, "}")]
	value := line[strings.LastIndex(line, " ")+1:]
	pretty := strings.NewReplacer(`"`, "", ",", ", ").Replace(labels)
	if !strings.Contains(page, "<td>"+pretty+"</td><td class=\"num\">"+value+"</td>") {
		t.Errorf("the page does not show %s = %s as /metrics does (%s)", pretty, value, line)
	}
	// /admin/upstreams shows the trip, the ejection and when it ends.
	var rows []upstream.EncoderState
	if err := json.Unmarshal([]byte(doWith(t, http.MethodGet, g.admin+"/admin/upstreams", "", auth).body), &rows); err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		b := r.Breaker
		switch r.Name {
		case "enc-1":
			if !b.Ejected || b.State != "open" || b.Trips != 1 || b.Ejections != 1 || b.EjectionSeconds != 30 ||
				b.EjectedUntil.Sub(b.EjectedAt) != 30*time.Second || b.TotalFailures != 0 {
				t.Errorf("enc-1's breaker in /admin/upstreams: %+v", b)
			}
		case "enc-0":
			if b.Ejected || b.Trips != 0 || !b.EjectedUntil.IsZero() || b.RecentCounted == 0 {
				t.Errorf("enc-0's breaker in /admin/upstreams: %+v", b)
			}
		}
	}
	if st := doWith(t, http.MethodGet, g.admin+"/nope", "", auth).status; st != http.StatusNotFound {
		t.Errorf("GET /nope: %d, want 404 (the page is only at /)", st)
	}
}

// statusCell is the text of the cell of class in enc's row of the page.
func statusCell(t *testing.T, page, enc, class string) string {
	t.Helper()
	row := page[strings.Index(page, `<tr data-encoder="`+enc+`">`):]
	row = row[:strings.Index(row, "</tr>")]
	m := regexp.MustCompile(`<td class="[^"]*\b` + class + `\b"[^>]*>([^<]*)</td>`).FindStringSubmatch(row)
	if m == nil {
		t.Fatalf("%s's row has no %s cell: %s", enc, class, row)
	}
	return m[1]
}

// The page's rates and latency come from the gateway's own metrics on its
// clock: over the time since start until a minute has passed, then over
// the last minute; a quiet minute reads 0/s. The fake clock stands still
// while exchanges run, so each takes 0 s: the p99 is interpolated inside
// the first bucket (1 ms), 990µs. The version is on the page, and the
// reloadable config is behind a <details>.
func TestStatusPageRatesOnTheClock(t *testing.T) {
	encs := startFakes(t, 2, nil)
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	g := startGatewayDeps(t, fakeURLs(encs), func(c *Config) { c.Affinity.UnknownWait = 0 }, zap.NewNop(), clk)
	encode := func(n int, prefix string) {
		t.Helper()
		for i := 0; i < n; i++ {
			id := ownedBy(t, g, "enc-0", fmt.Sprintf("%s-%d", prefix, i))
			if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
				t.Fatalf("/encode: %d %s", a.status, a.body)
			}
		}
	}
	page := func() string {
		t.Helper()
		a := do(t, http.MethodGet, g.admin+"/", "")
		if a.status != 200 {
			t.Fatalf("GET /: %d", a.status)
		}
		return a.body
	}
	clk.Advance(10 * time.Second)
	encode(5, "first")
	p := page()
	if got := statusCell(t, p, "enc-0", "rps"); got != "0.5/s" {
		t.Errorf("enc-0 after 5 /encodes in 10 s: %q, want 0.5/s", got)
	}
	if got := statusCell(t, p, "enc-0", "p99"); got != "990µs" {
		t.Errorf("enc-0's p99: %q, want 990µs", got)
	}
	if got := statusCell(t, p, "enc-0", "errors"); got != "0%" {
		t.Errorf("enc-0's errors: %q, want 0%%", got)
	}
	if got := statusCell(t, p, "enc-1", "rps"); got != "0/s" {
		t.Errorf("enc-1, idle: %q, want 0/s", got)
	}
	if got := statusCell(t, p, "enc-1", "p99"); got != "–" {
		t.Errorf("enc-1's p99 with nothing timed: %q, want –", got)
	}
	for _, want := range []string{`<span id="version">` + buildVersion(""), `<span id="uptime">10s</span>`,
		`<details id="reload">`, `<summary>Configuration a reload applies</summary>`} {
		if !strings.Contains(p, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	clk.Advance(20 * time.Second)
	encode(10, "second")
	if got := statusCell(t, page(), "enc-0", "rps"); got != "0.5/s" {
		t.Errorf("enc-0 after 15 /encodes in 30 s: %q, want 0.5/s", got)
	}
	clk.Advance(10 * time.Second)
	encode(25, "third")
	p = page()
	if got := statusCell(t, p, "enc-0", "rps"); got != "1/s" {
		t.Errorf("enc-0 after 40 /encodes in 40 s: %q, want 1/s", got)
	}
	if !strings.Contains(p, `<polyline points="`) {
		t.Error("the page draws no sparkline")
	}
	// A quiet minute later the window holds nothing.
	clk.Advance(61 * time.Second)
	page() // a sample, now the window's base
	clk.Advance(30 * time.Second)
	if got := statusCell(t, page(), "enc-0", "rps"); got != "0/s" {
		t.Errorf("enc-0 after a quiet minute: %q, want 0/s", got)
	}
}

// Beside a breaker that is open but not ejected (max_ejected_percent kept
// the encoder in service) the page says so, not how many failures came in
// a row; an ejected one shows its ejection in human units; ejections show
// how long ago the last was.
func TestStatusPageBreakerText(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	row := func(name string, b upstream.BreakerView, last time.Time) encoderRow {
		return encoderRow{EncoderState: upstream.EncoderState{Name: name, Breaker: b}, Rates: encRates{RPS: math.NaN(),
			ErrFrac: math.NaN(), P50: math.NaN(), P99: math.NaN()}, LastEjected: last}
	}
	v := statusView{Now: now, Encoders: []encoderRow{
		row("kept", upstream.BreakerView{State: "open", Trips: 2, ConsecutiveFailures: 7, Ejections: 1}, now.Add(-90*time.Second)),
		row("ejected", upstream.BreakerView{State: "open", Ejected: true, Trips: 3, Ejections: 3, EjectionSeconds: 120,
			EjectedUntil: now.Add(time.Minute)}, now.Add(-time.Minute)),
		row("fine", upstream.BreakerView{State: "closed", ConsecutiveFailures: 2}, time.Time{}),
	}}
	var b strings.Builder
	if err := statusPage.Execute(&b, v); err != nil {
		t.Fatal(err)
	}
	page := b.String()
	for _, want := range []string{
		`breaker open">open</span> <span class="muted">(not ejected: trip 2 kept in service by max_ejected_percent)</span>`,
		`(ejected: trip 3, for 2m, until `,
		`breaker closed">closed</span> <span class="muted">(2 failures in a row)</span>`,
		`last 1m30s ago`, `<span class="muted">never</span>`,
	} {
		if !strings.Contains(page, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	if strings.Contains(page, "7 failures in a row") {
		t.Error("an open breaker's row counts failures in a row")
	}
}
