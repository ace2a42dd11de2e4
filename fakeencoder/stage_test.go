package fakeencoder

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
)

func TestStageHookGetsTheEmbeddingShape(t *testing.T) {
	var mu sync.Mutex
	var got []string
	e := start(t, Options{Mode: ModeMooncake, TokensPerItem: 64, Dim: 256, ElementSize: 2,
		Stage: func(_ context.Context, id string, tokens, dim, elem int) error {
			mu.Lock()
			defer mu.Unlock()
			got = append(got, fmt.Sprint(id, " ", tokens, " ", dim, " ", elem))
			if id == "bad" {
				return errors.New("agent full")
			}
			return nil
		}})
	body := `{"req_id":"%s","mm_items":["a","b"],"modality":"IMAGE","num_parts":1,"part_idx":0}`
	if r := post(t, e, RouteEncode, strings.Replace(body, "%s", "ok", 1)); r.status != 200 {
		t.Fatalf("encode: %d %s", r.status, r.body)
	}
	r := post(t, e, RouteEncode, strings.Replace(body, "%s", "bad", 1))
	if r.status != 500 || !strings.Contains(r.body, "Internal encoding error: staging: agent full") {
		t.Fatalf("failed staging: %d %s", r.status, r.body)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 2 || got[0] != "ok 128 256 2" {
		t.Fatalf("Stage calls %q", got)
	}
}
