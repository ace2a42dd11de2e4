// Command floor is bench/proxy.sh's measuring stick: the least a Go
// program can spend per proxied request on this machine. It is an epoll
// loop with no HTTP server, router, gateway logic or goroutine per
// connection: it copies each HTTP/1.1 message (framed by Content-Length)
// from a client connection to an upstream connection of its own, and each
// answer back, as they are, with one goroutine.
//
//	floor -listen HOST:PORT -upstream HOST:PORT -wait raw|netpoll|blocking
//
// -wait is how the loop waits for the kernel, the one thing the runs
// compare:
//
//	raw       epoll_pwait as a raw system call on a locked thread, with a
//	          10 ms timeout: the Go scheduler never sees the wait (the
//	          thread keeps its P through it, so nothing else of the process
//	          runs meanwhile). The nearest Go gets to nginx's worker.
//	netpoll   the epoll descriptor registered with the runtime's poller, a
//	          non-blocking epoll_pwait each time it is readable: the way
//	          encgate's parked exchanges wait (internal/poller).
//	blocking  epoll_pwait as an ordinary system call on a locked thread:
//	          the runtime hands its P to another thread when the wait is
//	          long (sysmon), and takes one back after.
//
// It is not a proxy: no header is added or checked, a chunked message or
// one the buffer cannot hold closes its connection pair, and the upstream
// connection is opened at accept and closed with the client's.
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:19204", "address to listen on")
	upstream := flag.String("upstream", "127.0.0.1:19200", "address to forward to")
	wait := flag.String("wait", "raw", "how the loop waits: raw, netpoll or blocking")
	flag.Parse()
	mode, err := parseWait(*wait)
	if err == nil {
		err = serve(*listen, *upstream, mode, nil)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "floor:", err)
		os.Exit(1)
	}
}

// waitMode is -wait.
type waitMode int

const (
	waitRaw waitMode = iota
	waitNetpoll
	waitBlocking
)

func parseWait(s string) (waitMode, error) {
	switch s {
	case "raw":
		return waitRaw, nil
	case "netpoll":
		return waitNetpoll, nil
	case "blocking":
		return waitBlocking, nil
	}
	return 0, fmt.Errorf("-wait must be raw, netpoll or blocking, got %q", s)
}
