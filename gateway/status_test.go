package gateway

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/encgate/encgate/fakeencoder"
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
		`breaker open">open</span> <span class="muted">(ejected: trip 1, for 30 s, until `,
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
