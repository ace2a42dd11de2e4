package upstream

import "sync"

// ejectionGate is the pool's EjectionGate: breaker.max_ejected_percent over
// the fleet, as Envoy's max_ejection_percent.
//
// n counts the fleet's encoders that could take new work but for their
// breakers: neither down by active health (or forced unusable) nor
// draining. A trip of one of them ejects only when the ejected ones among
// them, it included, stay within floor(n × max_ejected_percent / 100) and
// below n: never the whole fleet, and never the only encoder. A trip of an
// encoder outside n (down, draining, or no longer in the fleet) always
// ejects: it takes no new work either way. The count is checked at each
// trip, never later: an ejected encoder that comes back up from active
// health can leave the share above the bound until an ejection ends.
//
// One mutex orders every decision with every record, so two trips at once
// cannot both pass. Admit runs under the tripping breaker's lock and takes
// no breaker's lock itself: it reads only the gate's own record and the
// encoders' atomics (health, draining), never another breaker.
type ejectionGate struct {
	p       *Pool
	mu      sync.Mutex
	ejected map[*Breaker]bool
}

// Admit implements EjectionGate.
func (g *ejectionGate) Admit(b *Breaker) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	var self *Encoder
	n, ejected := 0, 0
	for _, e := range g.p.Encoders() {
		if e.Breaker == b {
			self = e
		}
		if e.Down() || e.Draining() {
			continue
		}
		n++
		if g.ejected[e.Breaker] {
			ejected++
		}
	}
	if self != nil && !self.Down() && !self.Draining() {
		limit := n * b.cfg.MaxEjectedPercent / 100
		if limit > n-1 {
			limit = n - 1
		}
		if ejected+1 > limit {
			return false
		}
	}
	g.ejected[b] = true
	return true
}

// Release implements EjectionGate.
func (g *ejectionGate) Release(b *Breaker) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.ejected, b)
}
