package gpuagent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"
)

// Completion is what the receiver is told after a confirmed transfer: the
// fields of sglang's EmbeddingData ack that a receiver needs to mark the part
// ready, plus where the bytes went.
type Completion struct {
	ReqID         string `json:"req_id"`
	PartIdx       *int64 `json:"part_idx"` // null when the /send had none
	PrefillHost   string `json:"prefill_host"`
	EmbeddingPort int64  `json:"embedding_port"`
	EmbeddingSize int64  `json:"embedding_size"` // bytes written
	EmbeddingLen  int64  `json:"embedding_len"`  // tokens
	EmbeddingDim  int64  `json:"embedding_dim"`
	Dtype         string `json:"dtype"`
	SessionID     string `json:"session_id"`
	BufferAddress uint64 `json:"buffer_address"`
}

// Notifier tells a receiver that its bytes are in place. It is called once
// per confirmed transfer (so once per destination), after the transfer, on
// the /send path; an error fails that /send.
type Notifier interface {
	Notify(ctx context.Context, c Completion) error
}

// NopNotifier sends no notice (notify.http_url empty).
type NopNotifier struct{}

// Notify does nothing.
func (NopNotifier) Notify(context.Context, Completion) error { return nil }

// HTTPNotifier POSTs each Completion as JSON to URL; any 2xx is success.
type HTTPNotifier struct {
	URL    string
	Client *http.Client // nil means a client with a 30s timeout
}

var defaultNotifyClient = &http.Client{Timeout: 30 * time.Second}

// Notify posts c to n.URL.
func (n *HTTPNotifier) Notify(ctx context.Context, c Completion) error {
	body, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("notify %s: %w", n.URL, err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, n.URL, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("notify %s: %w", n.URL, err)
	}
	req.Header.Set("Content-Type", "application/json")
	client := n.Client
	if client == nil {
		client = defaultNotifyClient
	}
	resp, err := client.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // it repeats the URL
		}
		return fmt.Errorf("notify %s: %w", n.URL, err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("notify %s: status %d", n.URL, resp.StatusCode)
	}
	return nil
}

// CloseIdleConnections closes the client's idle connections (the agent
// calls it on shutdown).
func (n *HTTPNotifier) CloseIdleConnections() {
	if n.Client != nil {
		n.Client.CloseIdleConnections()
	}
}

var (
	_ Notifier = NopNotifier{}
	_ Notifier = (*HTTPNotifier)(nil)
)
