// Command heldclient is bench/held.sh's client: it holds many metadata pulls
// open through a proxy and publishes their metadata on the fake encoder.
//
//	heldclient hold   -addr HOST:PORT -n N -prefix P [-timeout D]
//	heldclient encode -addr HOST:PORT -n N -prefix P [-c C]
//
// hold opens N connections to addr, one at a time with a few in flight,
// and on each sends one POST /scheduler_receive_meta_data with body
// {"req_id":"<P><i>","part_idx":0}; it prints "sent N" when all are out.
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
	n := fs.Int("n", 4000, "number of req_ids")
	prefix := fs.String("prefix", "held-", "req_id prefix; req_ids are <prefix><i>")
	timeout := fs.Duration("timeout", 60*time.Second, "hold: wait this long for the answers after the stdin line")
	conc := fs.Int("c", 32, "encode: connections in parallel; hold: dials in flight")
	_ = fs.Parse(os.Args[2:])
	var ok bool
	switch os.Args[1] {
	case "hold":
		ok = hold(*addr, *n, *prefix, *timeout, *conc)
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
}

func hold(addr string, n int, prefix string, timeout time.Duration, dials int) bool {
	var releasedFlag atomic.Bool
	answers := make([]answer, n)
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
			id := fmt.Sprintf("%s%d", prefix, i)
			c, err := net.DialTimeout("tcp", addr, 10*time.Second)
			if err == nil {
				_, err = c.Write(request(addr, "/scheduler_receive_meta_data", `{"req_id":"`+id+`","part_idx":0}`, false))
			}
			if err != nil {
				dialErrs.Add(1)
				firstErr.CompareAndSwap(nil, err.Error())
				answers[i] = answer{kind: "missing", why: "dial/write: " + err.Error()}
				if c != nil {
					c.Close()
				}
				return
			}
			conns[i] = c
			readers.Add(1)
			go func() {
				defer readers.Done()
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
	readers.Wait()
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
	return answer{kind: "ok"}
}

func encode(addr string, n int, prefix string, conc int) bool {
	var next, good, bad atomic.Int64
	whys := map[string]int{}
	var mu sync.Mutex
	fail := func(why string) {
		bad.Add(1)
		mu.Lock()
		whys[why]++
		mu.Unlock()
	}
	var wg sync.WaitGroup
	for range max(conc, 1) {
		wg.Go(func() {
			var c net.Conn
			var br *bufio.Reader
			defer func() {
				if c != nil {
					c.Close()
				}
			}()
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				if c == nil {
					var err error
					if c, err = net.DialTimeout("tcp", addr, 10*time.Second); err != nil {
						c = nil
						fail("dial: " + err.Error())
						continue
					}
					br = bufio.NewReader(c)
				}
				body := fmt.Sprintf(`{"req_id":"%s%d","mm_items":["bench://image-0"],"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"127.0.0.1","embedding_port":null}`, prefix, i)
				_ = c.SetDeadline(time.Now().Add(30 * time.Second))
				_, err := c.Write(request(addr, "/encode", body, true))
				var resp *http.Response
				if err == nil {
					resp, err = http.ReadResponse(br, nil)
				}
				if err != nil {
					fail("exchange: " + err.Error())
					c.Close()
					c = nil
					continue
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				switch {
				case err != nil:
					fail("body: " + err.Error())
				case resp.StatusCode != http.StatusOK:
					fail(fmt.Sprintf("%d %s", resp.StatusCode, clip(b)))
				default:
					good.Add(1)
				}
				if err != nil || resp.Close {
					c.Close()
					c = nil
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
