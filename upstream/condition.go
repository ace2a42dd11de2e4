package upstream

import (
	"bytes"
	"fmt"
	"strconv"

	"go.yaml.in/yaml/v3"

	"github.com/encgate/encgate/internal/configfile"
)

// ConditionKind says what a Condition matches.
type ConditionKind int

// Condition kinds.
const (
	// OnStatus matches an answer with Status (and, when BodyContains is
	// set, a body containing it).
	OnStatus ConditionKind = iota
	// OnConnectFailure matches a failure where provably nothing reached the
	// encoder: refused or failed connect, a stale pooled connection, no free
	// connection.
	OnConnectFailure
	// OnTimeout matches an exchange that got no answer within its time.
	OnTimeout
)

// Condition is one entry of a retry_on or ignore list. In YAML it is either
// a word (connect_failure, timeout) or {status: 504, body_contains: "..."}.
type Condition struct {
	Kind         ConditionKind
	Status       int
	BodyContains string
}

// matches reports whether the verdict v (of an answer with body, when it
// is one) meets c. connect_failure is every outcome that provably sent
// nothing: a refused or failed connect, a stale pooled connection, the
// gateway's own limits, a busy breaker.
func (c Condition) matches(v *Verdict, body []byte) bool {
	switch c.Kind {
	case OnConnectFailure:
		return v.Reason == ReasonConnectFailure
	case OnTimeout:
		return v.Kind == KindTimeout
	default:
		return v.Kind == KindAnswered && v.Status == c.Status &&
			(c.BodyContains == "" || bytes.Contains(body, []byte(c.BodyContains)))
	}
}

// String writes c as it is written in YAML.
func (c Condition) String() string {
	switch c.Kind {
	case OnConnectFailure:
		return "connect_failure"
	case OnTimeout:
		return "timeout"
	}
	if c.BodyContains == "" {
		return "{status: " + strconv.Itoa(c.Status) + "}"
	}
	return fmt.Sprintf("{status: %d, body_contains: %q}", c.Status, c.BodyContains)
}

// UnmarshalYAML reads a word or a {status, body_contains} map.
func (c *Condition) UnmarshalYAML(n *yaml.Node) error {
	switch n.Kind {
	case yaml.ScalarNode:
		switch n.Value {
		case "connect_failure":
			*c = Condition{Kind: OnConnectFailure}
		case "timeout":
			*c = Condition{Kind: OnTimeout}
		default:
			return configfile.ValueError(n, "unknown condition %q (want connect_failure, timeout or {status: N, body_contains: \"...\"})", n.Value)
		}
		return nil
	case yaml.MappingNode:
		var m struct {
			Status       int
			BodyContains string
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			if v.Kind == yaml.AliasNode && v.Alias != nil {
				v = v.Alias
			}
			switch k.Value {
			case "status":
				st, err := strconv.Atoi(v.Value)
				if v.Kind != yaml.ScalarNode || err != nil {
					return configfile.ValueError(v, "condition status must be an HTTP status (100-599), got %q", v.Value)
				}
				m.Status = st
			case "body_contains":
				if v.Kind != yaml.ScalarNode {
					return configfile.ValueError(v, "body_contains must be a string")
				}
				m.BodyContains = v.Value
			default:
				return configfile.ValueError(k, "unknown key %q in a condition (want status, body_contains)", k.Value)
			}
		}
		if m.Status < 100 || m.Status > 599 {
			return configfile.ValueError(n, "condition status must be an HTTP status (100-599), got %d", m.Status)
		}
		*c = Condition{Kind: OnStatus, Status: m.Status, BodyContains: m.BodyContains}
		return nil
	}
	return configfile.ValueError(n, "want a condition word or map")
}

// MarshalYAML writes c back in the same forms.
func (c Condition) MarshalYAML() (any, error) {
	switch c.Kind {
	case OnConnectFailure:
		return "connect_failure", nil
	case OnTimeout:
		return "timeout", nil
	}
	m := map[string]any{"status": c.Status}
	if c.BodyContains != "" {
		m["body_contains"] = c.BodyContains
	}
	return m, nil
}
