//go:build linux

package main

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestFrameLen(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
	}{
		{"", 0},
		{"POST / HTTP/1.1\r\nHost: x\r\n", 0},
		{"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 27},
		{"POST / HTTP/1.1\r\ncontent-length: 3\r\n\r\nab", 0},
		{"POST / HTTP/1.1\r\ncontent-length: 3\r\n\r\nabcGET", 41},
		{"POST / HTTP/1.1\r\nContent-Length:  2 \r\n\r\nab", 42},
		{"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n", -1},
		{"POST / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", -1},
		{"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", -1},
		{strings.Repeat("a", maxMessage), -1},
	} {
		if got := frameLen([]byte(tc.in)); got != tc.want {
			t.Errorf("frameLen(%.40q) = %d, want %d", tc.in, got, tc.want)
		}
	}
}

// TestFloorForwards runs each wait mode against a real HTTP server:
// requests pipelined in one write, a request split across writes, and a
// chunked one, which the floor does not carry (its connection closes).
func TestFloorForwards(t *testing.T) {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Write(append([]byte(r.URL.Path+":"), b...))
	}))
	defer backend.Close()
	for _, mode := range []string{"raw", "netpoll", "blocking"} {
		t.Run(mode, func(t *testing.T) {
			wm, err := parseWait(mode)
			if err != nil {
				t.Fatal(err)
			}
			type started struct {
				addr string
				stop func()
			}
			up, done := make(chan started, 1), make(chan error, 1)
			go func() {
				done <- serve("127.0.0.1:0", strings.TrimPrefix(backend.URL, "http://"), wm, func(a string, stop func()) { up <- started{a, stop} })
			}()
			var s started
			select {
			case s = <-up:
			case err := <-done:
				t.Fatalf("serve: %v", err)
			}
			c, err := net.Dial("tcp", s.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			// A guard, so that a message the floor fails to forward fails the
			// test instead of hanging it.
			c.SetDeadline(time.Now().Add(10 * time.Second))
			br := bufio.NewReader(c)
			post := func(path, body string) string {
				return "POST " + path + " HTTP/1.1\r\nHost: floor\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
			}
			expect := func(want string) {
				t.Helper()
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatalf("reading the answer: %v", err)
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || string(b) != want {
					t.Fatalf("answer %d %q, want 200 %q", resp.StatusCode, b, want)
				}
			}
			if _, err := io.WriteString(c, post("/a", `{"n":1}`)+post("/b", `{"n":2}`)); err != nil {
				t.Fatal(err)
			}
			expect(`/a:{"n":1}`)
			expect(`/b:{"n":2}`)
			whole := post("/c", `{"n":3}`)
			for _, part := range []string{whole[:10], whole[10 : len(whole)-2], whole[len(whole)-2:]} {
				if _, err := io.WriteString(c, part); err != nil {
					t.Fatal(err)
				}
			}
			expect(`/c:{"n":3}`)
			io.WriteString(c, "POST /d HTTP/1.1\r\nHost: floor\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
			if b, err := br.ReadByte(); err != io.EOF {
				t.Fatalf("after a chunked request: read %q, %v; want the connection closed (EOF)", b, err)
			}
			s.stop()
			if err := <-done; err != nil {
				t.Fatalf("serve returned %v after stop", err)
			}
		})
	}
}

// TestSplitMessageIsForwardedWhole drives read on socket pairs, so that each
// part of a message is its own read: nothing is forwarded until the
// message is whole, then all of it at once, and a second message that came
// with the end of the first stays for its own end.
func TestSplitMessageIsForwardedWhole(t *testing.T) {
	pair := func() (int, int) {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Close(fds[0]); unix.Close(fds[1]) })
		return fds[0], fds[1]
	}
	a0, a1 := pair() // the client's connection: the test writes a1
	b0, b1 := pair() // the upstream's: the test reads b1
	c, u := &end{fd: a0}, &end{fd: b0}
	c.peer, u.peer = u, c
	l := &loop{ends: map[int]*end{a0: c, b0: u}, buf: make([]byte, maxMessage)}
	upstreamGot := func() string {
		b := make([]byte, 1024)
		n, err := unix.Read(b1, b)
		if err == unix.EAGAIN {
			return ""
		}
		if err != nil {
			t.Fatal(err)
		}
		return string(b[:n])
	}
	first := "POST /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
	second := "POST /b HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi"
	for i, step := range []struct{ write, want string }{
		{first[:12], ""},
		{first[12:40], ""},
		{first[40:] + second[:5], first},
		{second[5:], second},
	} {
		if _, err := unix.Write(a1, []byte(step.write)); err != nil {
			t.Fatal(err)
		}
		l.read(c)
		if got := upstreamGot(); got != step.want {
			t.Fatalf("step %d: upstream got %q, want %q", i, got, step.want)
		}
	}
}
