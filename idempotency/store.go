package idempotency

import (
	"context"
	"errors"
)

// Record is a stored encoder answer to one /send.
type Record struct {
	Status      int
	ContentType string // "" when the encoder sent none
	Body        []byte
	FP          Fingerprint
}

// ClaimState is the outcome of Store.Claim.
type ClaimState int

// Claim outcomes.
const (
	StateClaimed  ClaimState = iota // the caller forwards
	StateRecorded                   // an answer is stored: replay it
	StateReleased                   // the req_id was released and this destination never seen
	StateBusy                       // another replica is forwarding this key now
)

// Claim is the answer of Store.Claim.
type Claim struct {
	State  ClaimState
	Record *Record     // when StateRecorded
	FP     Fingerprint // the claim holder's, when StateBusy
}

// ErrUnavailable wraps every failure to reach a remote store.
var ErrUnavailable = errors.New("idempotency store unavailable")

// Store keeps send records and release state. Memory serves one gateway;
// Redis lets several replicas share keys. The six methods are the atomic
// steps of the protocol in DESIGN.md; none may be split without a race.
type Store interface {
	// Lookup returns the record for k (found), or whether k's req_id was
	// released with no record for k. It is the fast path for replays, so it
	// returns the record by value; its Body must not be modified.
	Lookup(ctx context.Context, k Key) (rec Record, found, released bool, err error)
	// Claim makes the caller the one that forwards k, unless k has a record,
	// its req_id was released, or another replica holds k (StateBusy).
	Claim(ctx context.Context, k Key, fp Fingerprint) (Claim, error)
	// Complete stores rec for k (taking ownership of rec.Body), ends the claim, counts k's destination
	// toward receiveCount (when > 0) and reports whether that released the
	// req_id.
	Complete(ctx context.Context, k Key, rec *Record, receiveCount int) (released bool, err error)
	// Abandon ends the claim on k without a record: nothing reached the
	// encoder, so the next caller may forward.
	Abandon(ctx context.Context, k Key) error
	// Await waits until another replica's claim on k ends and returns its
	// record; ok is false when the claim ended without one.
	Await(ctx context.Context, k Key) (rec *Record, ok bool, err error)
	// Inspect reports what is stored for reqID (admin API).
	Inspect(ctx context.Context, reqID string) (ReqView, error)
}

// ReqView is what the admin API shows for one req_id.
type ReqView struct {
	ReqID        string     `json:"req_id"`
	ReceiveCount int        `json:"receive_count"`
	Done         int        `json:"destinations_done"`
	Released     bool       `json:"released"`
	Destinations []DestView `json:"destinations"`
}

// DestView is one destination of a req_id.
type DestView struct {
	Dest   string `json:"destination"`
	State  string `json:"state"`            // "done" or "in_flight"
	Status int    `json:"status,omitempty"` // stored status when done
}
