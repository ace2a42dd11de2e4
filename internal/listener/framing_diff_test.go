package listener

import (
	"math/rand/v2"
	"strconv"
	"testing"
)

// FuzzFramerDifferential reads data with the framer and with refFramer
// (the byte-by-byte reference), both in the same reads, cut where seed
// says: after every read both must be in the same state, and a refusal
// must be the same one at the same byte.
func FuzzFramerDifferential(f *testing.F) {
	r := rand.New(rand.NewPCG(29, 2))
	for i := range 64 {
		f.Add(genFramerInput(r), uint64(i))
	}
	f.Fuzz(func(t *testing.T, data []byte, seed uint64) {
		if len(data) > 16<<10 {
			return
		}
		checkFramerDifferential(t, data, framerCuts(rand.New(rand.NewPCG(seed, 29)), len(data)))
	})
}

// TestFramerDifferentialRandom is FuzzFramerDifferential over generated
// requests (valid ones, then mutated) in random reads, from a fixed seed.
func TestFramerDifferentialRandom(t *testing.T) {
	r := rand.New(rand.NewPCG(6, 12))
	n := 20000
	if testing.Short() {
		n = 2000
	}
	for range n {
		data := genFramerInput(r)
		checkFramerDifferential(t, data, framerCuts(r, len(data)))
		checkFramerDifferential(t, data, []int{len(data)})
	}
}

// framerCuts returns where reads of n bytes end: random lengths, from one
// byte to many.
func framerCuts(r *rand.Rand, n int) []int {
	var cuts []int
	for at := 0; at < n; {
		var k int
		switch r.IntN(3) {
		case 0:
			k = 1 + r.IntN(3)
		case 1:
			k = 1 + r.IntN(24)
		default:
			k = 1 + r.IntN(256)
		}
		at = min(at+k, n)
		cuts = append(cuts, at)
	}
	return cuts
}

// checkFramerDifferential feeds data, cut at cuts, to both framers.
func checkFramerDifferential(t *testing.T, data []byte, cuts []int) {
	t.Helper()
	var nf framer
	var rf refFramer
	from := 0
	for _, to := range cuts {
		kn, en := nf.scan(append([]byte(nil), data[from:to]...))
		kr, er := rf.scan(append([]byte(nil), data[from:to]...))
		switch {
		case en != er:
			t.Fatalf("framer refuses with %v, the reference with %v (read %d:%d)\ninput %q", en, er, from, to, data)
		case en != nil && kn != kr:
			t.Fatalf("framer refuses at byte %d, the reference at %d (%v; read %d:%d)\ninput %q", from+kn, from+kr, en, from, to, data)
		case en != nil:
			return
		case nf != framer(rf):
			t.Fatalf("after read %d:%d the framer is in %+v, the reference in %+v\ninput %q", from, to, nf, rf, data)
		}
		from = to
	}
}

// genFramerInput returns one to three requests, well framed or nearly,
// and sometimes mutates a few of their bytes.
func genFramerInput(r *rand.Rand) []byte {
	var b []byte
	for range 1 + r.IntN(3) {
		b = appendGenRequest(b, r)
	}
	for range r.IntN(4) {
		if len(b) == 0 || r.IntN(2) == 0 {
			break
		}
		at := r.IntN(len(b))
		c := pick(r, "\r", "\n", " ", "\t", "\x00", "\x7f", ":", ";", "0", "a", "\x80", "\xff", string(rune(r.IntN(128))))[0]
		switch r.IntN(3) {
		case 0:
			b[at] = c
		case 1:
			b = append(b[:at], append([]byte{c}, b[at:]...)...)
		default:
			b = append(b[:at], b[at+1:]...)
		}
	}
	return b
}

func pick(r *rand.Rand, s ...string) string { return s[r.IntN(len(s))] }

// appendGenRequest appends a request with random framing.
func appendGenRequest(b []byte, r *rand.Rand) []byte {
	eol := func() string {
		if r.IntN(40) == 0 {
			return pick(r, "\n", "\r", "\r\r\n")
		}
		return "\r\n"
	}
	for range r.IntN(2) {
		b = append(b, eol()...)
	}
	b = append(b, pick(r, "GET", "POST", "PUT", "PROPFIND", "G@T", "")...)
	b = append(b, ' ')
	b = append(b, pick(r, "/", "/encode", "/scheduler_receive_url?x=1&y=%20", "http://a.b/c", "*", "", "/"+genText(r, 80, false))...)
	b = append(b, ' ')
	b = append(b, pick(r, "HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.10", "http/1.1")...)
	b = append(b, eol()...)
	cl, te := -1, false
	for range r.IntN(6) {
		switch r.IntN(6) {
		case 0:
			cl = r.IntN(40)
			v := strconv.Itoa(cl)
			if r.IntN(10) == 0 {
				v = pick(r, "", " ", "1 2", "-1", "99999999999999999999", "0x1", v+" ", " "+v, "\t"+v+"\t")
			}
			b = append(b, pick(r, "Content-Length", "content-length", "CONTENT-LENGTH", "Content-Length ", "Content-Lengths")...)
			b = append(b, ':')
			b = append(b, pick(r, " ", "", "\t")...)
			b = append(b, v...)
		case 1:
			te = true
			b = append(b, pick(r, "Transfer-Encoding", "transfer-encoding", "Transfer-Encodingx")...)
			b = append(b, ':')
			b = append(b, pick(r, " chunked", "chunked", " Chunked ", " identity", " chunked, chunked", " gzip, chunked", " chunk", "")...)
		default:
			b = append(b, pick(r, "Host", "Content-Type", "X-A", "Accept-Encoding", "content-lengt", "transfer-encoding-x", "A-Very-Long-Header-Name-Indeed", genName(r))...)
			b = append(b, ':')
			b = append(b, genText(r, 60, true)...)
		}
		b = append(b, eol()...)
		if r.IntN(30) == 0 {
			b = append(b, pick(r, " folded", "\tfolded")...)
			b = append(b, eol()...)
		}
	}
	b = append(b, eol()...)
	switch {
	case te && (cl < 0 || r.IntN(4) == 0):
		for range r.IntN(4) {
			n := 1 + r.IntN(30)
			b = strconv.AppendInt(b, int64(n), 16)
			b = append(b, pick(r, "", "", " ", ";ext=1", "; a=\"b\"", " ;x", "\t")...)
			b = append(b, eol()...)
			for range n {
				b = append(b, byte(r.IntN(256)))
			}
			b = append(b, eol()...)
		}
		b = append(b, pick(r, "0", "00", "0;x=y", "000000000000000000")...)
		b = append(b, eol()...)
		if r.IntN(3) == 0 {
			b = append(b, pick(r, "X-Trailer: v", "Content-Length: 3", "bad name: v")...)
			b = append(b, eol()...)
		}
		b = append(b, eol()...)
	case cl > 0:
		for range cl {
			b = append(b, byte(r.IntN(256)))
		}
	}
	return b
}

// genName is a random header name, mostly of token bytes.
func genName(r *rand.Rand) string {
	const tok = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~"
	n := 1 + r.IntN(24)
	b := make([]byte, n)
	for i := range b {
		b[i] = tok[r.IntN(len(tok))]
	}
	if r.IntN(20) == 0 {
		b[r.IntN(n)] = pick(r, " ", "\t", "@", "\x01", "\x80")[0]
	}
	return string(b)
}

// genText is up to max bytes of field value (value true) or request
// target text, now and then with a byte that does not belong.
func genText(r *rand.Rand, max int, value bool) string {
	n := r.IntN(max + 1)
	b := make([]byte, n)
	for i := range b {
		switch r.IntN(40) {
		case 0:
			b[i] = byte(0x80 + r.IntN(128))
		case 1:
			if value {
				b[i] = '\t'
			} else {
				b[i] = '%'
			}
		case 2:
			if r.IntN(10) == 0 {
				b[i] = pick(r, "\x00", "\x01", "\x7f", "\x1f", "\n", "\r", " ")[0]
				continue
			}
			fallthrough
		default:
			b[i] = byte(0x21 + r.IntN(0x7e-0x21+1))
		}
	}
	return string(b)
}

// BenchmarkFramerScan reads the proxy benchmark's request (bench/proxy.sh:
// wrk's POST of a small JSON body) with the framer and with the reference.
func BenchmarkFramerScan(b *testing.B) {
	body := `{"req_id":"bench-proxy-req-0","rank":0}`
	req := []byte("POST /scheduler_receive_url HTTP/1.1\r\nHost: 127.0.0.1:19101\r\nContent-Type: application/json\r\n" +
		"Content-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body)
	b.Run("framer", func(b *testing.B) {
		b.SetBytes(int64(len(req)))
		var f framer
		for b.Loop() {
			if _, err := f.scan(req); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("reference", func(b *testing.B) {
		b.SetBytes(int64(len(req)))
		var f refFramer
		for b.Loop() {
			if _, err := f.scan(req); err != nil {
				b.Fatal(err)
			}
		}
	})
}
