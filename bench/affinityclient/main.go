// Command affinityclient is bench/affinity.sh's client: a multi-turn chat
// workload whose turns re-send the earlier turns' images, posted as
// /encodes through a gateway in front of fake encoders with media caches.
//
//	affinityclient -addr HOST:PORT -fakes NAME=HOST:PORT,... [-conversations C] [-turns T] [-prefix P] [-c N]
//
// C conversations run at once. Turn t of conversation c has images 0..t
// (mm_items ["https://img.example/conv-<c>/img-<i>.png"]), each its own
// part, as sglang's tokenizer splits a request's media: t+1 /encodes at
// once, req_id <P>conv-<c>-<t>_local_part_<k>, num_parts t+1, part_idx k,
// modality IMAGE. The next turn starts when every part answered. A fake's
// cache keys the whole mm_items value, so a re-sent image is a cache hit
// exactly when it reaches an encoder that encoded it before.
//
// It prints one tab-separated line (the columns in the header line it
// prints first, both on stdout) and a summary on stderr:
//
//	encodes      /encodes posted (all must answer 200)
//	images       distinct images (each one's first send is a miss)
//	resent       /encodes of an image sent before
//	hits misses  the fakes' cache_hits and cache_misses deltas (GET /_fake/stats before and after)
//	predicted    re-sent /encodes whose X-Encgate-Encoder had encoded that image before
//	first first_hits  second sends of an image, and how many of them were predicted hits
//	p50_ms p99_ms /encode latency, client side
//	per_encoder  /encodes per encoder (name:count,...)
//	count_ratio  the busiest encoder's /encodes / the mean
//	load_ratio   the busiest encoder's mean in-flight /encodes (the time its
//	             /encodes took together / the run's wall time) / the mean
//	peak         the most /encodes in flight on one encoder at once
//	wall_s       the run's wall time
//	failed       /encodes not answered 200
//
// It exits 1 when an /encode failed, when the fakes' hits differ from the
// predicted ones (the cache would not be what the placement shows), or when
// the fakes' counts do not add up to the /encodes sent.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"time"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8080", "the gateway's address")
	fakes := flag.String("fakes", "", "the fake encoders, NAME=HOST:PORT,... (names as the gateway's encoders)")
	convs := flag.Int("conversations", 64, "conversations at once")
	turns := flag.Int("turns", 6, "turns per conversation")
	prefix := flag.String("prefix", "", "req_id prefix")
	conns := flag.Int("c", 512, "the most connections to the gateway")
	flag.Parse()
	fleet, err := parseFakes(*fakes)
	if err != nil || *convs < 1 || *turns < 1 {
		fmt.Fprintln(os.Stderr, "affinityclient: need -fakes NAME=HOST:PORT,..., -conversations >= 1, -turns >= 1:", err)
		os.Exit(2)
	}
	client := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{
		MaxConnsPerHost: *conns, MaxIdleConnsPerHost: *conns, IdleConnTimeout: 30 * time.Second}}
	before, err := fleetStats(client, fleet)
	if err != nil {
		fmt.Fprintln(os.Stderr, "affinityclient:", err)
		os.Exit(1)
	}
	r := run(client, *addr, *prefix, *convs, *turns)
	after, err := fleetStats(client, fleet)
	if err != nil {
		fmt.Fprintln(os.Stderr, "affinityclient:", err)
		os.Exit(1)
	}
	var hits, misses int64
	for i := range fleet {
		hits += after[i].CacheHits - before[i].CacheHits
		misses += after[i].CacheMisses - before[i].CacheMisses
	}
	ok := r.report(fleet, hits, misses)
	if !ok {
		os.Exit(1)
	}
}

type fake struct{ name, addr string }

func parseFakes(s string) ([]fake, error) {
	var out []fake
	for _, f := range strings.Split(s, ",") {
		name, addr, ok := strings.Cut(strings.TrimSpace(f), "=")
		if !ok || name == "" || addr == "" {
			return nil, fmt.Errorf("bad -fakes entry %q", f)
		}
		out = append(out, fake{name, addr})
	}
	return out, nil
}

type stats struct {
	CacheHits   int64 `json:"cache_hits"`
	CacheMisses int64 `json:"cache_misses"`
}

func fleetStats(c *http.Client, fleet []fake) ([]stats, error) {
	out := make([]stats, len(fleet))
	for i, f := range fleet {
		resp, err := c.Get("http://" + f.addr + "/_fake/stats")
		if err != nil {
			return nil, fmt.Errorf("%s stats: %w", f.name, err)
		}
		err = json.NewDecoder(resp.Body).Decode(&out[i])
		resp.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("%s stats: %w", f.name, err)
		}
	}
	return out, nil
}

// sent is one /encode's outcome.
type sent struct {
	conv, turn, image int
	encoder           string
	start, end        time.Time
	status            int
	why               string
}

type result struct {
	sends      []sent
	start, end time.Time
}

func run(client *http.Client, addr, prefix string, convs, turns int) result {
	var mu sync.Mutex
	var all []sent
	var wg sync.WaitGroup
	start := time.Now()
	for c := range convs {
		wg.Go(func() {
			for t := range turns {
				out := make([]sent, t+1)
				var parts sync.WaitGroup
				for k := 0; k <= t; k++ {
					parts.Go(func() {
						out[k] = encode(client, addr, fmt.Sprintf("%sconv-%d-%d_local_part_%d", prefix, c, t, k),
							fmt.Sprintf(`["https://img.example/conv-%d/img-%d.png"]`, c, k), t+1, k)
						out[k].conv, out[k].turn, out[k].image = c, t, k
					})
				}
				parts.Wait()
				mu.Lock()
				all = append(all, out...)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return result{sends: all, start: start, end: time.Now()}
}

func encode(client *http.Client, addr, id, mmItems string, parts, idx int) sent {
	body := fmt.Sprintf(`{"req_id":%q,"mm_items":%s,"modality":"IMAGE","num_parts":%d,"part_idx":%d,"prefill_host":"127.0.0.1","embedding_port":null}`,
		id, mmItems, parts, idx)
	s := sent{start: time.Now()}
	resp, err := client.Post("http://"+addr+"/encode", "application/json", strings.NewReader(body))
	if err != nil {
		s.end, s.why = time.Now(), err.Error()
		return s
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	s.end, s.status, s.encoder = time.Now(), resp.StatusCode, resp.Header.Get("X-Encgate-Encoder")
	switch {
	case err != nil:
		s.why = "body: " + err.Error()
	case resp.StatusCode != http.StatusOK:
		s.why = fmt.Sprintf("%d %s", resp.StatusCode, bytes.TrimSpace(b))
	}
	return s
}

func (r result) report(fleet []fake, hits, misses int64) bool {
	// Predicted hits: turns of a conversation run one after another, so an
	// image's earlier sends all ended before this one started.
	sort.Slice(r.sends, func(i, j int) bool {
		a, b := r.sends[i], r.sends[j]
		if a.conv != b.conv {
			return a.conv < b.conv
		}
		if a.image != b.image {
			return a.image < b.image
		}
		return a.turn < b.turn
	})
	type image struct{ conv, image int }
	holders := map[image]map[string]bool{}
	times := map[image]int{}
	var resent, predicted, first, firstHits, failed int
	whys := map[string]int{}
	perEnc := map[string]int{}
	busy := map[string]time.Duration{}
	lat := make([]time.Duration, 0, len(r.sends))
	for _, s := range r.sends {
		lat = append(lat, s.end.Sub(s.start))
		if s.why != "" {
			failed++
			whys[s.why]++
			continue
		}
		perEnc[s.encoder]++
		busy[s.encoder] += s.end.Sub(s.start)
		im := image{s.conv, s.image}
		n := times[im]
		times[im] = n + 1
		if n > 0 {
			resent++
			hit := holders[im][s.encoder]
			if hit {
				predicted++
			}
			if n == 1 {
				first++
				if hit {
					firstHits++
				}
			}
		}
		if holders[im] == nil {
			holders[im] = map[string]bool{}
		}
		holders[im][s.encoder] = true
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Microseconds()) / 1000
	}
	wall := r.end.Sub(r.start)
	var per []string
	maxCount, maxBusy := 0, time.Duration(0)
	var sumBusy time.Duration
	for _, f := range fleet {
		per = append(per, fmt.Sprintf("%s:%d", f.name, perEnc[f.name]))
		maxCount = max(maxCount, perEnc[f.name])
		maxBusy = max(maxBusy, busy[f.name])
		sumBusy += busy[f.name]
	}
	ok := len(r.sends) - failed
	countRatio := ratio(float64(maxCount), float64(ok)/float64(len(fleet)))
	loadRatio := ratio(float64(maxBusy), float64(sumBusy)/float64(len(fleet)))
	peak := peakInflight(r.sends)
	fmt.Println("encodes\timages\tresent\thits\tmisses\tpredicted\tfirst\tfirst_hits\tp50_ms\tp99_ms\tper_encoder\tcount_ratio\tload_ratio\tpeak\twall_s\tfailed")
	fmt.Printf("%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%.2f\t%.2f\t%s\t%.3f\t%.3f\t%d\t%.2f\t%d\n",
		len(r.sends), len(times), resent, hits, misses, predicted, first, firstHits, pct(0.50), pct(0.99),
		strings.Join(per, ","), countRatio, loadRatio, peak, wall.Seconds(), failed)
	fmt.Fprintf(os.Stderr, "affinityclient: %d /encodes (%d failed) in %.2f s; fakes: %d hits, %d misses; predicted %d hits of %d re-sent; p50 %.2f ms p99 %.2f ms; %s\n",
		len(r.sends), failed, wall.Seconds(), hits, misses, predicted, resent, pct(0.5), pct(0.99), strings.Join(per, " "))
	good := failed == 0
	if hits != int64(predicted) {
		fmt.Fprintf(os.Stderr, "affinityclient: the fakes counted %d cache hits, the placement predicts %d\n", hits, predicted)
		good = false
	}
	if hits+misses != int64(ok) {
		fmt.Fprintf(os.Stderr, "affinityclient: the fakes counted %d lookups for %d /encodes answered 200\n", hits+misses, ok)
		good = false
	}
	for why, n := range whys {
		fmt.Fprintf(os.Stderr, "affinityclient: %dx %s\n", n, why)
	}
	return good
}

func ratio(a, b float64) float64 {
	if b <= 0 {
		return 0
	}
	return a / b
}

// peakInflight is the most /encodes one encoder had in flight at once, as
// the client saw them (from sending to the last byte of the answer).
func peakInflight(sends []sent) int {
	type edge struct {
		at    time.Time
		delta int
	}
	byEnc := map[string][]edge{}
	for _, s := range sends {
		if s.why == "" {
			byEnc[s.encoder] = append(byEnc[s.encoder], edge{s.start, 1}, edge{s.end, -1})
		}
	}
	peak := 0
	for _, es := range byEnc {
		sort.Slice(es, func(i, j int) bool {
			if !es[i].at.Equal(es[j].at) {
				return es[i].at.Before(es[j].at)
			}
			return es[i].delta < es[j].delta // an end before a start at the same instant
		})
		n := 0
		for _, e := range es {
			n += e.delta
			peak = max(peak, n)
		}
	}
	return peak
}
