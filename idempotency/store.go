package idempotency

import (
	"context"
	"errors"
	"fmt"
)

// Record is a stored encoder answer to one /send.
type Record struct {
	Status      int
	ContentType string // "" when the encoder sent none
	Body        []byte
	FP          Fingerprint
	Encoder     string // the encoder that answered; "" when unknown
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

// ErrCompletionPending is what Complete returns when the store refused to
// write the record (Redis out of memory, read-only after a failover, or
// unreachable) and keeps it on this replica instead, retrying in the
// background: lookups and claims here answer from it, and the claim stays
// held so no other replica forwards the key meanwhile. The store counts and
// logs these itself. The error also satisfies errors.Is(err, ErrUnavailable).
var ErrCompletionPending = errors.New("record held on this replica until the store takes it")

// DestinationLimitError is Claim's refusal of a destination past the
// bound on destinations per req_id (done and in flight together). Nothing
// was forwarded; the gateway answers it with a 400 envelope.
type DestinationLimitError struct {
	ReqID string
	Dest  string
	Limit int
	Bound string // the config key that sets Limit
}

func (e *DestinationLimitError) Error() string {
	return fmt.Sprintf("/send for req_id=%s to %s refused: the req_id already has %d destinations, the most %s allows",
		e.ReqID, e.Dest, e.Limit, e.Bound)
}

// Store keeps send records and release state. Memory serves one gateway;
// Redis lets several replicas share keys. The six methods are the atomic
// steps of the protocol in DESIGN.md; none may be split without a race.
//
// Release follows sglang NEW's note_send_done(req_id, receive_count, dest):
// each /send carries its own receive_count, only /sends that carry one (> 0)
// count their destination, and a req_id is released once the distinct
// destinations counted reach the receive_count of the /send being
// completed. Release is final.
type Store interface {
	// Lookup returns the record for k (found), or whether k's req_id was
	// released with no record for k. It is the fast path for replays, so it
	// returns the record by value; its Body must not be modified.
	Lookup(ctx context.Context, k Key) (rec Record, found, released bool, err error)
	// Claim makes the caller the one that forwards k, unless k has a record,
	// its req_id was released, or another replica holds k (StateBusy). A
	// destination past the req_id's bound is refused with a
	// *DestinationLimitError; a granted claim counts toward that bound
	// until Complete or Abandon ends it.
	Claim(ctx context.Context, k Key, fp Fingerprint) (Claim, error)
	// Complete stores rec for k (taking ownership of rec.Body) and ends the
	// claim. When receiveCount > 0 it counts k's destination and compares
	// this call's own receiveCount with the distinct destinations counted so
	// far, as sglang's note_send_done does, and reports whether the req_id
	// is now released. A store that could not write the record but keeps it
	// for a retry returns an error matching ErrCompletionPending.
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
