// Command heldclient is bench/held.sh's client: it holds many metadata pulls
// open through a proxy and publishes their metadata on the fake encoder.
//
//	heldclient hold   -addr HOST:PORT -n N -prefix P [-tp T] [-timeout D] [-release FAKE -rc C]
//	heldclient encode -addr HOST:PORT -n N -prefix P [-c C]
//
// hold opens N connections to addr, one at a time with a few in flight,
// and on each sends one POST /scheduler_receive_meta_data with body
// {"req_id":"<P><i>","part_idx":0}; it prints "sent N" when all are out.
// With -tp T, T pulls share each req_id (<P><i/T>), as the T receiver TP
// ranks of one part each pull its metadata; N must be a multiple of T.
// A reader per connection waits for its answer from then on. A line on
// stdin (or stdin closing) says the release starts (send it before running
// encode); from then it waits up to -timeout for the answers and prints
// "ok X wrong Y missing Z early E": ok is a 200 whose body names the
// connection's req_id and a positive embedding_size; wrong is any other
// answer; missing is no answer (timeout, or the connection closed);
// early counts the answers (of any kind) that came before the stdin line.
// A summary of what was not ok goes to stderr. Exit 0 only when all N are ok
// and none came early.
//
// With -release FAKE, hold releases the pulls itself after the stdin line
// (no encode run needed): C workers (-rc, 1 by default: one pull at a time)
// each take the next req_id in order, read the clock (t0) just before
// writing its POST /encode to FAKE on a keep-alive connection of their own,
// read the /encode answer, and wait for that pull's answer (the answers of
// its T pulls, with -tp) before taking the next; the pull's reader reads the clock (t1) once it has read the answer's
// whole body. So at most C pulls are being answered at once and the figure is
// the latency a pull's answer takes through the proxy, not a queue. Before
// the ok line it prints "latency_us n X p50 P p99 Q max M" over the ok
// answers' t1 - t0 (nearest rank, microseconds), and "encoded X failed Y".
// Both times come from this process's monotonic clock.
//
// encode sends POST /encode for <P>0 .. <P>N-1 over C keep-alive
// connections and prints "encoded X failed Y"; exit 0 only when all N
// answered 200.
//
// Requests are written by hand on plain net.Conn and answers read with
// http.ReadResponse: no client pool decides how many connections exist.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: heldclient hold|encode -addr HOST:PORT -n N -prefix P")
		os.Exit(2)
	}
	raiseNofile()
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	addr := fs.String("addr", "127.0.0.1:8080", "address to connect to")
	n := fs.Int("n", 4000, "hold: number of pulls; encode: number of req_ids")
	tp := fs.Int("tp", 1, "hold: pulls per req_id (a part's TP ranks); n must be a multiple of it")
	prefix := fs.String("prefix", "held-", "req_id prefix; req_ids are <prefix><i>")
	timeout := fs.Duration("timeout", 60*time.Second, "hold: wait this long for the answers after the stdin line")
	conc := fs.Int("c", 32, "encode: connections in parallel; hold: dials in flight")
	release := fs.String("release", "", "hold: after the stdin line, POST /encode for each req_id to this address (the fake) and time each pull's answer")
	rc := fs.Int("rc", 1, "hold with -release: pulls released at once (each worker waits for its pull's answer before the next)")
	_ = fs.Parse(os.Args[2:])
	var ok bool
	switch os.Args[1] {
	case "hold":
		if *tp < 1 || *n%*tp != 0 {
			fmt.Fprintf(os.Stderr, "heldclient: -n %d is not a multiple of -tp %d\n", *n, *tp)
			os.Exit(2)
		}
		ok = hold(*addr, *n, *tp, *prefix, *timeout, *conc, *release, *rc)
	case "encode":
		ok = encode(*addr, *n, *prefix, *conc)
	default:
		fmt.Fprintf(os.Stderr, "heldclient: unknown subcommand %q\n", os.Args[1])
		os.Exit(2)
	}
	if !ok {
		os.Exit(1)
	}
}

// raiseNofile raises RLIMIT_NOFILE's soft limit to the hard one.
func raiseNofile() {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		fmt.Fprintln(os.Stderr, "heldclient: getrlimit:", err)
		return
	}
	l.Cur = l.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		fmt.Fprintln(os.Stderr, "heldclient: setrlimit:", err)
	}
}

func request(addr, path, body string, keepAlive bool) []byte {
	conn := "close"
	if keepAlive {
		conn = "keep-alive"
	}
	return fmt.Appendf(nil, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: %s\r\n\r\n%s",
		path, addr, len(body), conn, body)
}

// answer is one connection's outcome.
type answer struct {
	kind  string // "ok", "wrong", "missing"
	why   string
	early bool
	at    time.Time // when the whole answer had been read (zero if none)
}

func hold(addr string, n, tp int, prefix string, timeout time.Duration, dials int, release string, rc int) bool {
	var releasedFlag atomic.Bool
	answers := make([]answer, n)
	done := make([]chan struct{}, n) // closed once answers[i] is final
	for i := range done {
		done[i] = make(chan struct{})
	}
	conns := make([]net.Conn, n)
	var readers sync.WaitGroup
	sem := make(chan struct{}, max(dials, 1))
	var dialErrs atomic.Int64
	var firstErr atomic.Value
	var dialing sync.WaitGroup
	for i := range n {
		sem <- struct{}{}
		dialing.Add(1)
		go func() {
			defer dialing.Done()
			defer func() { <-sem }()
			id := fmt.Sprintf("%s%d", prefix, i/tp)
			c, err := net.DialTimeout("tcp", addr, 10*time.Second)
			if err == nil {
				_, err = c.Write(request(addr, "/scheduler_receive_meta_data", `{"req_id":"`+id+`","part_idx":0}`, false))
			}
			if err != nil {
				dialErrs.Add(1)
				firstErr.CompareAndSwap(nil, err.Error())
				answers[i] = answer{kind: "missing", why: "dial/write: " + err.Error()}
				close(done[i])
				if c != nil {
					c.Close()
				}
				return
			}
			conns[i] = c
			readers.Add(1)
			go func() {
				defer readers.Done()
				defer close(done[i])
				answers[i] = read(c, id)
				answers[i].early = !releasedFlag.Load()
			}()
		}()
	}
	dialing.Wait()
	if d := dialErrs.Load(); d > 0 {
		fmt.Printf("sent %d (failed %d: %v)\n", int64(n)-d, d, firstErr.Load())
	} else {
		fmt.Printf("sent %d\n", n)
	}
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	releasedFlag.Store(true)
	deadline := time.Now().Add(timeout)
	for _, c := range conns {
		if c != nil {
			_ = c.SetReadDeadline(deadline)
		}
	}
	var sent []time.Time
	if release != "" {
		sent = releaseEach(release, n, tp, prefix, rc, deadline, done)
	}
	readers.Wait()
	if sent != nil {
		reportLatency(answers, sent)
	}
	counts := map[string]int{}
	whys := map[string]int{}
	early := 0
	for _, a := range answers {
		counts[a.kind]++
		if a.early {
			early++
		}
		if a.kind != "ok" {
			whys[a.kind+": "+a.why]++
		}
	}
	fmt.Printf("ok %d wrong %d missing %d early %d\n", counts["ok"], counts["wrong"], counts["missing"], early)
	reportWhys(whys)
	return counts["ok"] == n && early == 0
}

// read reads id's answer on c.
func read(c net.Conn, id string) answer {
	defer c.Close()
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			return answer{kind: "missing", why: "no answer before the timeout"}
		}
		return answer{kind: "missing", why: "no answer: " + err.Error()}
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	at := time.Now()
	resp.Body.Close()
	if err != nil {
		return answer{kind: "wrong", why: fmt.Sprintf("%d, body cut: %v", resp.StatusCode, err)}
	}
	if resp.StatusCode != http.StatusOK {
		return answer{kind: "wrong", why: fmt.Sprintf("%d %s", resp.StatusCode, clip(body))}
	}
	var m struct {
		ReqID         string `json:"req_id"`
		EmbeddingSize int64  `json:"embedding_size"`
	}
	if err := json.Unmarshal(body, &m); err != nil || m.ReqID != id || m.EmbeddingSize <= 0 {
		return answer{kind: "wrong", why: "200 with another body: " + clip(body)}
	}
	return answer{kind: "ok", at: at}
}

// releaseEach posts /encode for <prefix>0 .. <prefix>n/tp-1 to addr with rc
// workers, each waiting for the answers of its req_id's tp pulls (done[i*tp]
// .. done[i*tp+tp-1]) before its next, and returns, per pull, when its
// req_id's /encode was sent (the zero time for one never sent). It prints
// "encoded X failed Y" (req_ids).
func releaseEach(addr string, n, tp int, prefix string, rc int, deadline time.Time, done []chan struct{}) []time.Time {
	sent := make([]time.Time, n)
	parts := n / tp
	var next, good atomic.Int64
	var mu sync.Mutex
	whys := map[string]int{}
	expired := make(chan struct{})
	stop := time.AfterFunc(time.Until(deadline), func() { close(expired) })
	defer stop.Stop()
	var wg sync.WaitGroup
	for range max(rc, 1) {
		wg.Go(func() {
			var e encoder
			defer e.close()
			for {
				i := int(next.Add(1) - 1)
				if i >= parts {
					return
				}
				if err := e.post(addr, fmt.Sprintf("%s%d", prefix, i), &sent[i*tp]); err != "" {
					mu.Lock()
					whys[err]++
					mu.Unlock()
				} else {
					good.Add(1)
				}
				for k := i*tp + 1; k < i*tp+tp; k++ {
					sent[k] = sent[i*tp] // its ranks' pulls share the /encode
				}
				for k := i * tp; k < i*tp+tp; k++ {
					select {
					case <-done[k]:
					case <-expired:
						return // the readers' deadline has passed too
					}
				}
			}
		})
	}
	wg.Wait()
	fmt.Printf("encoded %d failed %d\n", good.Load(), int64(parts)-good.Load())
	reportWhys(whys)
	return sent
}

// reportLatency prints the ok answers' latency from their /encode being
// sent to their whole answer read.
func reportLatency(answers []answer, sent []time.Time) {
	us := latencies(answers, sent)
	if len(us) == 0 {
		fmt.Println("latency_us n 0 p50 0 p99 0 max 0")
		return
	}
	fmt.Printf("latency_us n %d p50 %.0f p99 %.0f max %.0f\n", len(us), rank(us, 0.50), rank(us, 0.99), us[len(us)-1])
}

// latencies is t1 - t0 in microseconds, sorted, for each answer that is ok,
// came after the release and whose /encode was sent.
func latencies(answers []answer, sent []time.Time) []float64 {
	var us []float64
	for i, a := range answers {
		if a.kind == "ok" && !a.early && !sent[i].IsZero() {
			us = append(us, float64(a.at.Sub(sent[i]).Nanoseconds())/1e3)
		}
	}
	sort.Float64s(us)
	return us
}

// rank is the nearest-rank q quantile of sorted xs.
func rank(xs []float64, q float64) float64 {
	k := int(math.Ceil(q*float64(len(xs)))) - 1
	return xs[min(max(k, 0), len(xs)-1)]
}

// encoder posts /encode requests on one keep-alive connection, dialled on
// first use and again after an error or a close.
type encoder struct {
	c  net.Conn
	br *bufio.Reader
}

func (e *encoder) close() {
	if e.c != nil {
		e.c.Close()
		e.c = nil
	}
}

// post sends /encode for id and reads its answer; it stores the time just
// before the request's write in *t0 (when non-nil). It returns "" for a 200,
// else why not.
func (e *encoder) post(addr, id string, t0 *time.Time) string {
	if e.c == nil {
		c, err := net.DialTimeout("tcp", addr, 10*time.Second)
		if err != nil {
			return "dial: " + err.Error()
		}
		e.c, e.br = c, bufio.NewReader(c)
	}
	body := fmt.Sprintf(`{"req_id":"%s","mm_items":["bench://image-0"],"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"127.0.0.1","embedding_port":null}`, id)
	req := request(addr, "/encode", body, true)
	_ = e.c.SetDeadline(time.Now().Add(30 * time.Second))
	if t0 != nil {
		*t0 = time.Now()
	}
	_, err := e.c.Write(req)
	var resp *http.Response
	if err == nil {
		resp, err = http.ReadResponse(e.br, nil)
	}
	if err != nil {
		e.close()
		return "exchange: " + err.Error()
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.Close {
		e.close()
	}
	switch {
	case err != nil:
		return "body: " + err.Error()
	case resp.StatusCode != http.StatusOK:
		return fmt.Sprintf("%d %s", resp.StatusCode, clip(b))
	}
	return ""
}

func encode(addr string, n int, prefix string, conc int) bool {
	var next, good, bad atomic.Int64
	whys := map[string]int{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range max(conc, 1) {
		wg.Go(func() {
			var e encoder
			defer e.close()
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				if why := e.post(addr, fmt.Sprintf("%s%d", prefix, i), nil); why != "" {
					bad.Add(1)
					mu.Lock()
					whys[why]++
					mu.Unlock()
				} else {
					good.Add(1)
				}
			}
		})
	}
	wg.Wait()
	fmt.Printf("encoded %d failed %d\n", good.Load(), bad.Load())
	reportWhys(whys)
	return good.Load() == int64(n)
}

// reportWhys writes the reasons, most frequent first, to stderr.
func reportWhys(whys map[string]int) {
	keys := make([]string, 0, len(whys))
	for k := range whys {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return whys[keys[i]] > whys[keys[j]] })
	for i, k := range keys {
		if i == 10 {
			fmt.Fprintf(os.Stderr, "heldclient: ... and %d other reasons\n", len(keys)-10)
			break
		}
		fmt.Fprintf(os.Stderr, "heldclient: %dx %s\n", whys[k], k)
	}
}

func clip(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > 160 {
		s = s[:160] + "..."
	}
	return s
}
