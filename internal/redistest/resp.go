package redistest

import (
	"bufio"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"
)

// ioTimeout bounds one helper command: the dial, AUTH and one request.
const ioTimeout = time.Second

// conn is the helper's own minimal RESP client, one fresh connection per
// check: readiness probes and the questions Start asks a node (INFO, CLUSTER
// INFO, SENTINEL ...) need no pool and leave no goroutine behind.
type conn struct {
	c net.Conn
	r *bufio.Reader
}

// replyError is a Redis error reply (-ERR ..., -NOAUTH ...).
type replyError string

func (e replyError) Error() string { return "redis: " + string(e) }

// dial connects to addr (over TLS when tlsConf is not nil) and, with a
// password, sends AUTH and expects +OK.
func dial(addr, password string, tlsConf *tls.Config) (*conn, error) {
	d := &net.Dialer{Timeout: ioTimeout}
	var nc net.Conn
	var err error
	if tlsConf != nil {
		nc, err = tls.DialWithDialer(d, "tcp", addr, tlsConf)
	} else {
		nc, err = d.Dial("tcp", addr)
	}
	if err != nil {
		return nil, err
	}
	c := &conn{c: nc, r: bufio.NewReader(nc)}
	if password != "" {
		if err := c.expect("OK", "AUTH", password); err != nil {
			c.close()
			return nil, err
		}
	}
	return c, nil
}

func (c *conn) close() { _ = c.c.Close() }

// do sends args as one RESP array (binary-safe, unlike an inline command)
// and reads one reply: a string (simple or bulk), an int64, nil, or []any.
// An error reply comes back as a replyError.
func (c *conn) do(args ...string) (any, error) {
	_ = c.c.SetDeadline(time.Now().Add(ioTimeout))
	var b strings.Builder
	b.WriteString("*" + strconv.Itoa(len(args)) + "\r\n")
	for _, a := range args {
		b.WriteString("$" + strconv.Itoa(len(a)) + "\r\n" + a + "\r\n")
	}
	if _, err := c.c.Write([]byte(b.String())); err != nil {
		return nil, err
	}
	return c.read(0)
}

// expect runs a command and wants the status or string reply want.
func (c *conn) expect(want string, args ...string) error {
	v, err := c.do(args...)
	if err != nil {
		return err
	}
	if s, ok := v.(string); !ok || s != want {
		return fmt.Errorf("unexpected %s answer %q", args[0], fmt.Sprint(v))
	}
	return nil
}

// str runs a command that answers a string (INFO, CLUSTER INFO).
func (c *conn) str(args ...string) (string, error) {
	v, err := c.do(args...)
	if err != nil {
		return "", err
	}
	s, ok := v.(string)
	if !ok {
		return "", fmt.Errorf("%s answered %T, not a string", args[0], v)
	}
	return s, nil
}

// maxDepth bounds nested arrays; the helper's questions nest two deep.
const maxDepth = 8

func (c *conn) read(depth int) (any, error) {
	if depth > maxDepth {
		return nil, errors.New("reply nested too deep")
	}
	line, err := c.r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	line = strings.TrimSuffix(line, "\r\n")
	if line == "" {
		return nil, errors.New("empty reply line")
	}
	body := line[1:]
	switch line[0] {
	case '+':
		return body, nil
	case '-':
		return nil, replyError(body)
	case ':':
		return strconv.ParseInt(body, 10, 64)
	case '$':
		n, err := strconv.Atoi(body)
		if err != nil || n < -1 || n > 64<<20 {
			return nil, fmt.Errorf("bad bulk length %q", body)
		}
		if n == -1 {
			return nil, nil
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(c.r, buf); err != nil {
			return nil, err
		}
		return string(buf[:n]), nil
	case '*':
		n, err := strconv.Atoi(body)
		if err != nil || n < -1 || n > 1<<16 {
			return nil, fmt.Errorf("bad array length %q", body)
		}
		if n == -1 {
			return nil, nil
		}
		out := make([]any, n)
		for i := range out {
			// An error inside an array is a value, not a failure of the read.
			v, err := c.read(depth + 1)
			var re replyError
			if errors.As(err, &re) {
				v, err = re, nil
			}
			if err != nil {
				return nil, err
			}
			out[i] = v
		}
		return out, nil
	}
	return nil, fmt.Errorf("unknown reply type %q", line)
}

// query runs one command on a fresh connection.
func query(addr, password string, tlsConf *tls.Config, args ...string) (any, error) {
	c, err := dial(addr, password, tlsConf)
	if err != nil {
		return nil, err
	}
	defer c.close()
	return c.do(args...)
}

// queryString runs one command that answers a string on a fresh connection.
func queryString(addr, password string, tlsConf *tls.Config, args ...string) (string, error) {
	c, err := dial(addr, password, tlsConf)
	if err != nil {
		return "", err
	}
	defer c.close()
	return c.str(args...)
}

// ping sends PING over a fresh plain connection and expects PONG; with a
// password it sends AUTH first and expects OK.
func ping(addr, password string) error { return pingTLS(addr, password, nil) }

// pingTLS is ping over TLS when tlsConf is not nil.
func pingTLS(addr, password string, tlsConf *tls.Config) error {
	c, err := dial(addr, password, tlsConf)
	if err != nil {
		return err
	}
	defer c.close()
	return c.expect("PONG", "PING")
}

// infoField returns the value of field in an INFO-style "k:v" text, and
// whether it is there.
func infoField(info, field string) (string, bool) {
	for _, l := range strings.Split(info, "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(l), ":"); ok && k == field {
			return v, true
		}
	}
	return "", false
}
