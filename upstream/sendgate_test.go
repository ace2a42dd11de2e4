package upstream

import (
	"sync"
	"sync/atomic"
	"testing"
)

// The gate runs at most its bound at once, queues the rest as functions
// (no goroutine), and starts them in order as slots are left.
func TestSendGateBoundsAndQueues(t *testing.T) {
	g := newSendGate(2)
	var running atomic.Int32
	started := make(chan int, 5)
	release := make(chan struct{})
	var done sync.WaitGroup
	for i := range 5 {
		done.Add(1)
		g.enter(func() {
			defer done.Done()
			running.Add(1)
			started <- i
			<-release
			running.Add(-1)
			g.leave()
		})
	}
	first := map[int]bool{<-started: true, <-started: true}
	if !first[0] || !first[1] {
		t.Fatalf("first two started %v, want 0 and 1", first)
	}
	g.mu.Lock()
	queued := len(g.q)
	g.mu.Unlock()
	if queued != 3 || running.Load() != 2 {
		t.Fatalf("%d queued, %d running; want 3 and 2", queued, running.Load())
	}
	release <- struct{}{} // one leaves: the next queued starts
	if i := <-started; i != 2 {
		t.Fatalf("started %d after a slot freed, want 2", i)
	}
	close(release)
	for range 2 {
		<-started
	}
	done.Wait()
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.free != 2 || len(g.q) != 0 {
		t.Fatalf("free %d, queued %d at the end; want 2 and 0", g.free, len(g.q))
	}
}
