package gpuagent

import (
	"net/http"
	"net/url"
	"strings"
	"testing"
)

// The agent's status page lists what is staged (a req_id escaped: it is a
// stager's text) and its counters, in human units, and needs the admin
// token: without it a browser gets the sign-in form.
func TestStatusPageShowsStagedEntries(t *testing.T) {
	const admin = "admin-token-0123456789"
	a := startAgent(t, func(c *Config) { c.Admin.Token = admin; c.Staging.CapacityBytes = 256 << 20 }, nil, nil)
	a.stageOK(t, "seen-1", 4, 8)
	odd := `odd<b>"` // a req_id with markup in it
	if r := a.stage(t, url.QueryEscape(odd), 4, 8, "bfloat16", make([]byte, 64)); r.status != http.StatusOK {
		t.Fatalf("stage %q: %d %s", odd, r.status, r.body)
	}
	if r := doAs(t, http.MethodGet, a.admin+"/", nil, ""); r.status != http.StatusUnauthorized || !strings.Contains(r.body, `<form class="signin"`) {
		t.Fatalf("GET / without the admin token: %d, want 401 and the sign-in form", r.status)
	}
	r := doAs(t, http.MethodGet, a.admin+"/", nil, "Bearer "+admin)
	if r.status != http.StatusOK {
		t.Fatalf("GET /: %d %s", r.status, r.body)
	}
	for _, want := range []string{`data-req-id="seen-1"`, `<span class="state staged">staged</span>`,
		`data-metric="encgate_agent_transfers_total"`, `<meta http-equiv="refresh"`, "odd&lt;b&gt;&#34;",
		`of <span id="capacity">256 MiB</span>`, `<td class="num">64 B</td>`} {
		if !strings.Contains(r.body, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	if strings.Contains(r.body, "odd<b>") {
		t.Error("a req_id's markup reached the page unescaped")
	}
}
