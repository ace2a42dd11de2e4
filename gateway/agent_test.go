package gateway

import (
	"strings"
	"testing"
)

// With encoders[].agent set, that encoder's /sends go to its node's agent
// (deduplicated by the gateway as before); everything else to the encoder.
func TestSendsGoToTheNodesAgent(t *testing.T) {
	encs := startFakes(t, 1, nil)
	agent := newScripted(t)
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Encoders[0].Agent = agent.URL })
	const id = "agent_local_part_0"
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
		t.Fatalf("encode %d", a.status)
	}
	body := tpSend(id, 0, 2)
	first := post(t, g.base+"/send", body)
	again := post(t, g.base+"/send", body)
	if first.status != 200 || first.body != "null" || again.header.Get("X-Encgate-Replayed") != "true" {
		t.Fatalf("first %d %s; again %d replayed=%q", first.status, first.body, again.status, again.header.Get("X-Encgate-Replayed"))
	}
	if got := agent.received("/send"); len(got) != 1 || got[0] != body {
		t.Fatalf("the agent received %q", got)
	}
	if n := encs[0].Stats().Routes["/send"]; n != 0 {
		t.Fatalf("the encoder received %d /sends", n)
	}
	if n := metadataCalls(encs[0], id); n != 0 {
		t.Fatalf("unexpected metadata calls: %d", n)
	}
	if m := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id)); m.status != 200 || len(agent.received("/scheduler_receive_meta_data")) != 0 {
		t.Fatalf("metadata must go to the encoder: %d", m.status)
	}
}

func TestAgentURLIsValidated(t *testing.T) {
	c := validConfig()
	c.Encoders[1].Agent = "tcp://node:7401"
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), `encoders[1].agent: scheme must be http or https, got "tcp"`) {
		t.Fatalf("Validate = %v", err)
	}
}
