package gateway

import (
	"strconv"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/upstream"
)

// headerAttempts tells the caller how many exchanges with encoders its
// request took (on every answer that went upstream).
const headerAttempts = "X-Encgate-Attempts"

// picker chooses the encoder for attempt n (1-based); nil ends the attempts.
// It may be called more than once for the same n.
type picker func(n int) *upstream.Encoder

// attempt runs c's exchanges under its route's retry policy: it forwards,
// and retries what the policy allows while the deadline, the attempt limit
// and the route's retry budget allow. The last answer (or the gateway's
// envelope for the last failure) is in the caller's response. limit, when
// positive, caps the deadline. It reports whether any attempt may have
// reached an encoder.
func (s *Server) attempt(c *call, pick picker, limit time.Duration) (delivered bool) {
	rt := s.retry.Load()
	pol := rt.Policy(c.route.label)
	now := s.clk.Now()
	deadline := now.Add(pol.Deadline.D())
	if limit > 0 && now.Add(limit).Before(deadline) {
		deadline = now.Add(limit)
	}
	budget := s.budgets.Load().get(c.route.label)
	budget.Request()
	var lastErr error
	n := 0
	for enc := pick(1); enc != nil; {
		n++
		c.enc = enc
		if n > 1 { // the first attempt starts now; later ones after a wait
			now = s.clk.Now()
		}
		lastErr = s.exchange(c, min(pol.PerTryTimeout.D(), deadline.Sub(now)))
		delivered = delivered || lastErr == nil || !upstream.NotDelivered(lastErr)
		if n >= pol.MaxAttempts {
			break
		}
		o := s.outcome(c, lastErr)
		reason, ok := pol.Retryable(o)
		if !ok {
			break
		}
		next := pick(n + 1)
		if next == nil {
			break
		}
		wait := pol.Backoff(n, s.rand(), s.retryAfter(c, o))
		if s.clk.Now().Add(wait).After(deadline) {
			break
		}
		if !budget.Retry() {
			s.metrics.budgetExhausted.WithLabelValues(c.route.label).Inc()
			break
		}
		s.metrics.retries.WithLabelValues(c.route.label, reason).Inc()
		s.metrics.backoff.Observe(wait.Seconds())
		if !s.sleep(c.ctx, wait) {
			break
		}
		enc = pick(n + 1) // again: the world may have changed while waiting
	}
	if lastErr != nil {
		s.failCall(c, lastErr)
	}
	if n > 0 {
		c.ctx.Response.Header.Set(headerAttempts, strconv.Itoa(n))
	}
	return delivered
}

// exchange is one attempt with c.enc: the breaker is told the outcome when
// it admits the request. A follow-up goes even when a half-open breaker has
// no probe slot free (its state cannot move elsewhere); it is then not
// counted. An /encode does not: it is refused unsent, and its policy may
// send it to the next encoder.
func (s *Server) exchange(c *call, timeout time.Duration) error {
	if timeout <= 0 {
		return fasthttp.ErrTimeout
	}
	c.ctx.Response.Reset()
	// Reset forgets the server's NoDefaultContentType: an answer without a
	// Content-Type must reach the caller without one.
	c.ctx.Response.Header.SetNoDefaultContentType(true)
	done, counted := c.enc.Breaker.Allow()
	if !counted && c.route.kind == kindEncode {
		return &upstream.BreakerBusyError{Encoder: c.enc.Name, State: c.enc.Breaker.State().String()}
	}
	err := s.forward(c, timeout)
	if counted {
		done(s.outcome(c, err))
	}
	return err
}

// outcome describes the last exchange for policies and breakers.
func (s *Server) outcome(c *call, err error) upstream.Outcome {
	if err != nil {
		return upstream.Outcome{Err: err}
	}
	return upstream.Outcome{Status: c.ctx.Response.StatusCode(), Body: c.ctx.Response.Body()}
}

// retryAfter is the encoder's Retry-After on the last answer, if any.
func (s *Server) retryAfter(c *call, o upstream.Outcome) time.Duration {
	if o.Err != nil {
		return 0
	}
	v := c.ctx.Response.Header.Peek(fasthttp.HeaderRetryAfter)
	if len(v) == 0 {
		return 0
	}
	d, _ := upstream.ParseRetryAfter(v, s.clk.Now())
	return d
}

// sleep waits d on the injected clock; false when the server shuts down.
func (s *Server) sleep(ctx *fasthttp.RequestCtx, d time.Duration) bool {
	t := s.clk.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C():
		return true
	case <-ctx.Done():
		return false
	}
}

// budgets holds one retry budget per route with a policy.
type budgets map[string]*upstream.Budget

func (b budgets) get(route string) *upstream.Budget { return b[route] }

func (s *Server) newBudgets(cfg upstream.BudgetConfig) *budgets {
	b := budgets{}
	for _, r := range []string{"metadata", "receive_url", "encode", "send"} {
		b[r] = upstream.NewBudget(cfg, s.clk)
	}
	return &b
}
