package gpuagent

import (
	_ "embed"
	"net/http"
	"time"

	"github.com/encgate/encgate/internal/admin"
)

// The agent's status page (GET / on its admin listener, behind admin.token
// like /admin/staged): what it holds staged, for whom, and how its
// transfers and acks went, as one self-contained page that refreshes
// itself (internal/admin).

//go:embed status.html
var agentStatusHTML string

var agentStatusPage = admin.Parse("agent-status", agentStatusHTML, nil)

// agentStatusFamilies are the counters the page shows, in order.
var agentStatusFamilies = []admin.Family{
	{Title: "Transfers, by result", Name: "encgate_agent_transfers_total"},
	{Title: "Bytes transferred", Name: "encgate_agent_transfer_bytes_total", Unit: "bytes"},
	{Title: "Acks, by result", Name: "encgate_agent_acks_total"},
	{Title: "Requests, by route and code", Name: "encgate_agent_requests_total"},
	{Title: "Refused for want of a token, by door", Name: "encgate_agent_unauthorized_total"},
	{Title: "Stages abandoned, by reason", Name: "encgate_agent_stages_abandoned_total"},
	{Title: "Owner conflicts", Name: "encgate_agent_owner_conflicts_total"},
}

type agentStatusView struct {
	Now         time.Time
	Ready       bool
	SignedIn    bool // through the session cookie: the page offers sign-out
	HeldBytes   int64
	Capacity    int64
	Entries     []StagedEntry
	Counters    []admin.Group
	Refresh     int
	ShownMax    int
	EntriesMore int
}

// agentStatusMaxEntries bounds the entries the page lists (the JSON of
// /admin/staged has them all).
const agentStatusMaxEntries = 200

func (a *Agent) serveStatus(w http.ResponseWriter, r *http.Request) {
	now := a.clk.Now()
	held, _ := a.store.usage()
	entries := a.store.snapshot(now)
	v := agentStatusView{Now: now, Ready: a.ready.Load(), SignedIn: admin.SignedIn(r), HeldBytes: held, Capacity: int64(a.cfg.Staging.CapacityBytes),
		Counters: admin.Gather(a.reg, agentStatusFamilies), Refresh: 5, ShownMax: agentStatusMaxEntries}
	if len(entries) > agentStatusMaxEntries {
		v.EntriesMore = len(entries) - agentStatusMaxEntries
		entries = entries[:agentStatusMaxEntries]
	}
	v.Entries = entries
	admin.Write(w, agentStatusPage, v)
}
