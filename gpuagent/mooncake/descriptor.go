package mooncake

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"time"
)

// Buffer is one registered buffer of a segment: for TCP, Name is the segment
// name (not a location) and Addr the absolute virtual address in the peer.
type Buffer struct {
	Name   string `json:"name"`
	Addr   uint64 `json:"addr"`
	Length uint64 `json:"length"`
}

// Descriptor is the part of a Mooncake segment descriptor (the Metadata
// handshake reply, reference §2.3) that the TCP transport uses.
type Descriptor struct {
	// Name is the segment name; in P2P mode "host:rpc_port", and the data
	// connection goes to that host.
	Name string
	// Protocols is "protocol": one entry for the single-protocol form, several
	// for the multi-protocol array form.
	Protocols []string
	// TCPDataPort is "tcp_data_port" (0 when absent).
	TCPDataPort int
	// TCPProtoVersion is "tcp_proto_version"; 1 when absent (Mooncake <= v0.3.11).
	TCPProtoVersion int
	// Buffers are the buffers reachable over TCP: every buffer of a
	// single-protocol descriptor, and those whose own "protocol" is "tcp" in
	// the multi-protocol form.
	Buffers []Buffer
}

var (
	errCorrupted = errors.New("mooncake: corrupted segment descriptor")

	// The body is not one JSON object, so not a descriptor at all.
	errDescNotJSON   = errors.New("mooncake: segment descriptor is not valid JSON")
	errDescTrailing  = errors.New("mooncake: segment descriptor: data after the JSON object")
	errDescNotObject = errors.New("mooncake: segment descriptor is not a JSON object")
)

// DecodeDescriptor decodes a segment descriptor as Mooncake's decodeSegmentDesc
// does, for the fields above. "protocol" may be a string or (multi-protocol
// builds) an array, where each buffer carries its own "protocol". Numbers are
// decoded exactly up to 2^64-1; a fraction, exponent, sign or larger value is
// an error. For tcp buffers an empty name or a zero addr or length makes the
// whole descriptor "corrupted segment descriptor", as in Mooncake. Unknown
// fields (timestamp, devices, rkeys, ...) are ignored.
//
// Errors name the field and the check it failed, never its value nor any
// other byte of b (b comes from the peer).
func DecodeDescriptor(b []byte) (Descriptor, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var top map[string]any
	if err := dec.Decode(&top); err != nil {
		// Not wrapped: encoding/json's text quotes the offending bytes.
		if _, isType := err.(*json.UnmarshalTypeError); isType {
			return Descriptor{}, errDescNotObject
		}
		return Descriptor{}, errDescNotJSON
	}
	if _, err := dec.Token(); err != io.EOF {
		return Descriptor{}, errDescTrailing
	}
	if top == nil {
		return Descriptor{}, errDescNotObject
	}
	var d Descriptor
	var err error
	if d.Name, err = optString(top, "name"); err != nil {
		return Descriptor{}, err
	}
	multi := false
	switch p := top["protocol"].(type) {
	case string:
		d.Protocols = []string{p}
	case []any:
		multi = true
		for _, e := range p {
			s, ok := e.(string)
			if !ok {
				return Descriptor{}, errors.New("mooncake: segment descriptor: protocol array holds a non-string")
			}
			d.Protocols = append(d.Protocols, s)
		}
	case nil:
		return Descriptor{}, errors.New("mooncake: segment descriptor has no protocol")
	default:
		return Descriptor{}, errors.New("mooncake: segment descriptor: protocol is neither a string nor an array")
	}
	port, ok, err := optUint(top, "tcp_data_port")
	if err != nil {
		return Descriptor{}, err
	}
	if ok && port > 65535 {
		return Descriptor{}, errors.New("mooncake: segment descriptor: tcp_data_port is above 65535")
	}
	d.TCPDataPort = int(port)
	d.TCPProtoVersion = 1
	if v, present := top["tcp_proto_version"]; present {
		n, isNum := v.(json.Number)
		iv, perr := strconv.ParseInt(string(n), 10, 32)
		if !isNum || perr != nil {
			return Descriptor{}, errors.New("mooncake: segment descriptor: tcp_proto_version is not an integer")
		}
		d.TCPProtoVersion = int(iv)
	}
	bufs, present := top["buffers"]
	if !present || bufs == nil {
		return d, nil
	}
	list, ok := bufs.([]any)
	if !ok {
		return Descriptor{}, errors.New("mooncake: segment descriptor: buffers is not an array")
	}
	for _, e := range list {
		obj, ok := e.(map[string]any)
		if !ok {
			return Descriptor{}, errors.New("mooncake: segment descriptor: a buffer is not an object")
		}
		proto := ""
		if len(d.Protocols) == 1 {
			proto = d.Protocols[0]
		}
		if multi {
			if p, present := obj["protocol"]; present {
				s, ok := p.(string)
				if !ok {
					return Descriptor{}, errors.New("mooncake: segment descriptor: a buffer's protocol is not a string")
				}
				proto = s
			}
			if proto != "tcp" {
				continue // another transport's buffer: not reachable over TCP
			}
		}
		buf, err := decodeBuffer(obj)
		if err != nil {
			return Descriptor{}, err
		}
		if proto == "tcp" && (buf.Name == "" || buf.Addr == 0 || buf.Length == 0) {
			return Descriptor{}, fmt.Errorf("%w: a tcp buffer has an empty name, a zero addr or a zero length", errCorrupted)
		}
		d.Buffers = append(d.Buffers, buf)
	}
	return d, nil
}

func decodeBuffer(obj map[string]any) (Buffer, error) {
	var b Buffer
	var err error
	if b.Name, err = optString(obj, "name"); err != nil {
		return Buffer{}, err
	}
	if b.Addr, _, err = optUint(obj, "addr"); err != nil {
		return Buffer{}, err
	}
	if b.Length, _, err = optUint(obj, "length"); err != nil {
		return Buffer{}, err
	}
	return b, nil
}

func optString(m map[string]any, key string) (string, error) {
	v, present := m[key]
	if !present || v == nil {
		return "", nil
	}
	s, ok := v.(string)
	if !ok {
		return "", fmt.Errorf("mooncake: segment descriptor: %s is not a string", key)
	}
	return s, nil
}

// optUint decodes an unsigned JSON integer exactly (json.Number, never float64).
func optUint(m map[string]any, key string) (uint64, bool, error) {
	v, present := m[key]
	if !present || v == nil {
		return 0, false, nil
	}
	n, ok := v.(json.Number)
	if !ok {
		return 0, false, fmt.Errorf("mooncake: segment descriptor: %s is not a number", key)
	}
	u, err := strconv.ParseUint(string(n), 10, 64)
	if err != nil {
		return 0, false, fmt.Errorf("mooncake: segment descriptor: %s is not an integer in [0, 2^64-1]", key)
	}
	return u, true, nil
}

// EncodeJSON encodes d in the single-protocol form, as a v0.3.12 receiver
// publishes it (reference §9): keys sorted, a "timestamp" of the current local
// time ("2006-01-02 15:04:05.000000"), and jsoncpp's trailing newline. The
// protocol is Protocols[0] ("tcp" when empty). tcp_proto_version is written
// only when it is 2 or more: a descriptor without it is how Mooncake <= v0.3.11
// says v1.
func (d Descriptor) EncodeJSON() []byte {
	return d.encodeJSON(time.Now())
}

func (d Descriptor) encodeJSON(ts time.Time) []byte {
	proto := "tcp"
	if len(d.Protocols) > 0 {
		proto = d.Protocols[0]
	}
	b := []byte(`{"buffers":[`)
	for i, buf := range d.Buffers {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"addr":`...)
		b = strconv.AppendUint(b, buf.Addr, 10)
		b = append(b, `,"length":`...)
		b = strconv.AppendUint(b, buf.Length, 10)
		b = append(b, `,"name":`...)
		b = appendJSONString(b, buf.Name)
		b = append(b, '}')
	}
	b = append(b, `],"name":`...)
	b = appendJSONString(b, d.Name)
	b = append(b, `,"protocol":`...)
	b = appendJSONString(b, proto)
	b = append(b, `,"tcp_data_port":`...)
	b = strconv.AppendInt(b, int64(d.TCPDataPort), 10)
	if d.TCPProtoVersion >= 2 {
		b = append(b, `,"tcp_proto_version":`...)
		b = strconv.AppendInt(b, int64(d.TCPProtoVersion), 10)
	}
	b = append(b, `,"timestamp":`...)
	b = appendJSONString(b, ts.Format("2006-01-02 15:04:05.000000"))
	return append(b, "}\n"...)
}

func appendJSONString(dst []byte, s string) []byte {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s) // a string always encodes
	return append(dst, bytes.TrimSuffix(buf.Bytes(), []byte{'\n'})...)
}

// HasTCP reports whether "tcp" is among the descriptor's protocols.
func (d Descriptor) HasTCP() bool {
	return slices.Contains(d.Protocols, "tcp")
}

// Contains reports whether [addr, addr+size) lies inside one of d.Buffers. A
// size of 0 and a range whose end passes 2^64-1 are never inside, as on a v2
// server (reference §1.6).
func (d Descriptor) Contains(addr, size uint64) bool {
	return findBuffer(d.Buffers, addr, size) >= 0
}

// findBuffer returns the index of the buffer holding [addr, addr+size), or -1.
func findBuffer(bufs []Buffer, addr, size uint64) int {
	if size == 0 || addr+size < addr {
		return -1
	}
	for i, b := range bufs {
		if addr < b.Addr {
			continue
		}
		off := addr - b.Addr
		if off <= b.Length && size <= b.Length-off {
			return i
		}
	}
	return -1
}

// ParseSessionID splits a Mooncake session ID ("host:port", "[v6addr]:port")
// into its host (without brackets) and port (1-65535).
func ParseSessionID(s string) (host string, port int, err error) {
	h, p, err := net.SplitHostPort(s)
	if err != nil {
		return "", 0, fmt.Errorf("mooncake: session id %q: %w", s, err)
	}
	if h == "" {
		return "", 0, fmt.Errorf("mooncake: session id %q has no host", s)
	}
	n, err := strconv.Atoi(p)
	if err != nil || n < 1 || n > 65535 {
		return "", 0, fmt.Errorf("mooncake: session id %q: port %q is not in 1-65535", s, p)
	}
	return h, n, nil
}
