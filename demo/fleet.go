package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/gateway"
)

// FleetResult is what the fleet phase saw: an encoder that joined by
// registering itself with the gateway's bootstrap API, then left while it
// held pins.
type FleetResult struct {
	Name        string // the registered encoder's name in the gateway (host:port)
	Joined      time.Duration
	NewEncodes  int // /encodes of the phase
	TookEncodes int // of which it took
	Pinned      int // req_ids pinned to it when it left
	PinnedOK    int // of their follow-ups, answered 200 by it while it drained
	AfterLeft   int // new /encodes it took while draining (must be 0)
	Dropped     time.Duration
}

// fleetPhase starts one more fake encoder that registers itself with the
// gateway's bootstrap listener under its token, as sglang's encoders do with
// --encoder-register-urls http://HOST:PORT/t/<token>; waits for it to join; sends new /encodes; makes
// it unregister while req_ids are pinned to it; shows that their
// follow-ups still reach it and new work does not; releases them (/send);
// and waits for the gateway to drop it.
func fleetPhase(ctx context.Context, gw *gateway.Server, bootToken string) (*FleetResult, error) {
	boot := "http://" + gw.BootstrapAddr() + "/t/" + bootToken
	enc := fakeencoder.New(fakeencoder.Options{Name: "enc-reg", Mode: fakeencoder.ModeMooncake,
		RegisterURLs: []string{boot}, RegistrationInterval: 50 * time.Millisecond})
	start := time.Now()
	if err := enc.Start("127.0.0.1:0"); err != nil {
		return nil, err
	}
	defer enc.Close()
	r := &FleetResult{Name: strings.TrimPrefix(enc.URL(), "http://")}
	if err := waitFor(ctx, 10*time.Second, func() bool {
		e, ok := gw.Pool().Lookup(r.Name)
		return ok && e.Usable()
	}); err != nil {
		return nil, fmt.Errorf("the registered encoder did not join: %w", err)
	}
	r.Joined = time.Since(start)
	c := &http.Client{Timeout: 10 * time.Second}
	base := "http://" + gw.Addr()
	var pinned []string
	for i := 0; i < 24; i++ {
		id := fmt.Sprintf("fleet-%02d_local_part_0", i)
		by, err := postTo(ctx, c, base+"/encode", fmt.Sprintf(`{"req_id":%q,"mm_items":["https://example.com/fleet-%d.png"],"modality":"IMAGE","num_parts":1,"part_idx":0}`, id, i))
		if err != nil {
			return nil, err
		}
		r.NewEncodes++
		if by == r.Name {
			r.TookEncodes++
			pinned = append(pinned, id)
		}
	}
	ctxU, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := enc.Unregister(ctxU); err != nil {
		return nil, err
	}
	if err := waitFor(ctx, 10*time.Second, func() bool {
		e, ok := gw.Pool().Lookup(r.Name)
		return ok && e.Draining()
	}); err != nil {
		return nil, fmt.Errorf("the unregistered encoder did not start draining: %w", err)
	}
	r.Pinned = len(pinned)
	for _, id := range pinned {
		if by, err := postTo(ctx, c, base+"/scheduler_receive_meta_data", fmt.Sprintf(`{"req_id":%q,"part_idx":0}`, id)); err == nil && by == r.Name {
			r.PinnedOK++
		}
	}
	for i := 0; i < 24; i++ {
		id := fmt.Sprintf("fleet-after-%02d_local_part_0", i)
		by, err := postTo(ctx, c, base+"/encode", fmt.Sprintf(`{"req_id":%q,"mm_items":["https://example.com/fleet-after-%d.png"],"modality":"IMAGE","num_parts":1,"part_idx":0}`, id, i))
		if err != nil {
			return nil, err
		}
		if by == r.Name {
			r.AfterLeft++
		}
	}
	// Its req_ids are released by their /send (one receiver rank each).
	released := time.Now()
	for _, id := range pinned {
		body := fmt.Sprintf(`{"req_id":%q,"part_idx":0,"embedding_size":1024,"prefill_host":"127.0.0.1","embedding_port":40000,`+
			`"session_id":"127.0.0.1:17000","buffer_address":4096,"receive_count":1}`, id)
		if _, err := postTo(ctx, c, base+"/send", body); err != nil {
			return nil, err
		}
	}
	if err := waitFor(ctx, 10*time.Second, func() bool { _, ok := gw.Pool().Lookup(r.Name); return !ok }); err != nil {
		return nil, fmt.Errorf("the drained encoder was not dropped: %w", err)
	}
	r.Dropped = time.Since(released)
	return r, nil
}

// postTo posts body and returns the encoder that answered (X-Encgate-Encoder);
// an answer other than 200 is an error.
func postTo(ctx context.Context, c *http.Client, url, body string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("POST %s: %d %s", url, resp.StatusCode, b)
	}
	return resp.Header.Get("X-Encgate-Encoder"), nil
}

// waitFor polls cond every 10 ms until it holds or d passes: the demo
// watches the gateway's state the way an operator's script would.
func waitFor(ctx context.Context, d time.Duration, cond func() bool) error {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return errors.New("timed out")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

func printFleet(w io.Writer, r *FleetResult) {
	fmt.Fprintf(w, "fleet: %s registered itself through the bootstrap API under its token (as --encoder-register-urls http://HOST:PORT/t/<token> does) and joined after its health check in %s; it took %d of %d new /encodes\n",
		r.Name, r.Joined.Round(time.Millisecond), r.TookEncodes, r.NewEncodes)
	fmt.Fprintf(w, "fleet: it unregistered while %d req_ids were pinned to it and drained: %d of %d of their follow-ups answered 200 by it, %d of 24 new /encodes sent to it; dropped %s after its last req_id was released\n",
		r.Pinned, r.PinnedOK, r.Pinned, r.AfterLeft, r.Dropped.Round(time.Millisecond))
}

func (r *FleetResult) check() error {
	switch {
	case r.TookEncodes == 0:
		return fmt.Errorf("fleet: the registered encoder took none of %d /encodes", r.NewEncodes)
	case r.PinnedOK != r.Pinned:
		return fmt.Errorf("fleet: %d of %d pinned follow-ups reached the draining encoder", r.PinnedOK, r.Pinned)
	case r.AfterLeft != 0:
		return fmt.Errorf("fleet: the draining encoder took %d new /encodes", r.AfterLeft)
	}
	return nil
}
