package mooncake

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

// §2.3's example, as printed in the reference (timestamp elided there).
const refExample23 = `{"name":"10.0.0.2:15321","protocol":"tcp","tcp_data_port":16012,"tcp_proto_version":2,"timestamp":"…","buffers":[{"name":"10.0.0.2:15321","addr":140234567892992,"length":33554432}]}`

// §9's descriptor, as the real engine sent it (frame length 210 = 208 + '\n' + type).
const refObserved9 = `{"buffers":[{"addr":140398412431360,"length":67108864,"name":"127.0.0.1:16654"}],"name":"127.0.0.1:16654","protocol":"tcp","tcp_data_port":16004,"tcp_proto_version":2,"timestamp":"2026-11-29 19:37:35.580114"}` + "\n"

func TestDecodeDescriptor(t *testing.T) {
	tests := []struct {
		name string
		json string
		want Descriptor
	}{
		{
			name: "reference §2.3 single protocol",
			json: refExample23,
			want: Descriptor{
				Name: "10.0.0.2:15321", Protocols: []string{"tcp"}, TCPDataPort: 16012, TCPProtoVersion: 2,
				Buffers: []Buffer{{Name: "10.0.0.2:15321", Addr: 140234567892992, Length: 33554432}},
			},
		},
		{
			name: "reference §9 observed",
			json: refObserved9,
			want: Descriptor{
				Name: "127.0.0.1:16654", Protocols: []string{"tcp"}, TCPDataPort: 16004, TCPProtoVersion: 2,
				Buffers: []Buffer{{Name: "127.0.0.1:16654", Addr: 140398412431360, Length: 67108864}},
			},
		},
		{
			name: "missing tcp_proto_version means v1 (Mooncake <= v0.3.11)",
			json: `{"name":"10.0.0.2:15321","protocol":"tcp","tcp_data_port":16012,"buffers":[{"name":"10.0.0.2:15321","addr":4096,"length":8}]}`,
			want: Descriptor{
				Name: "10.0.0.2:15321", Protocols: []string{"tcp"}, TCPDataPort: 16012, TCPProtoVersion: 1,
				Buffers: []Buffer{{Name: "10.0.0.2:15321", Addr: 4096, Length: 8}},
			},
		},
		{
			name: "multi-protocol array form keeps the tcp buffers",
			json: `{"name":"h:1","protocol":["tcp","hip"],"tcp_data_port":16000,"tcp_proto_version":2,
				"buffers":[{"name":"h:1","addr":4096,"length":100,"protocol":"tcp"},
				           {"name":"cuda:0","addr":8192,"length":100,"protocol":"hip","shm_name":"abc"},
				           {"name":"h:1","addr":65536,"length":7,"protocol":"tcp"}]}`,
			want: Descriptor{
				Name: "h:1", Protocols: []string{"tcp", "hip"}, TCPDataPort: 16000, TCPProtoVersion: 2,
				Buffers: []Buffer{{Name: "h:1", Addr: 4096, Length: 100}, {Name: "h:1", Addr: 65536, Length: 7}},
			},
		},
		{
			name: "multi-protocol without tcp",
			json: `{"name":"h:1","protocol":["rdma","cxl"],"buffers":[{"name":"cpu:0","addr":4096,"length":100,"protocol":"rdma","rkey":[1],"lkey":[1]}]}`,
			want: Descriptor{Name: "h:1", Protocols: []string{"rdma", "cxl"}, TCPProtoVersion: 1},
		},
		{
			name: "max uint64 addr and length, exactly",
			json: `{"name":"h:1","protocol":"tcp","tcp_data_port":1,"buffers":[{"name":"h:1","addr":18446744073709551615,"length":18446744073709551615},{"name":"h:1","addr":9007199254740993,"length":1}]}`,
			want: Descriptor{
				Name: "h:1", Protocols: []string{"tcp"}, TCPDataPort: 1, TCPProtoVersion: 1,
				Buffers: []Buffer{{Name: "h:1", Addr: 1<<64 - 1, Length: 1<<64 - 1}, {Name: "h:1", Addr: 1<<53 + 1, Length: 1}},
			},
		},
		{
			name: "rdma single protocol is decoded, not tcp-validated",
			json: `{"name":"h:1","protocol":"rdma","devices":[{"name":"mlx5_0","lid":0,"gid":"x"}],"buffers":[{"name":"cpu:0","addr":4096,"length":100,"rkey":[7],"lkey":[7]}]}`,
			want: Descriptor{Name: "h:1", Protocols: []string{"rdma"}, TCPProtoVersion: 1, Buffers: []Buffer{{Name: "cpu:0", Addr: 4096, Length: 100}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := DecodeDescriptor([]byte(tt.json))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("got  %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestDecodeDescriptorRejects(t *testing.T) {
	tests := []struct {
		name, json, errHas string
	}{
		{"empty buffer name", `{"name":"h:1","protocol":"tcp","tcp_data_port":1,"buffers":[{"name":"","addr":4096,"length":8}]}`, "corrupted segment descriptor"},
		{"missing buffer name", `{"name":"h:1","protocol":"tcp","tcp_data_port":1,"buffers":[{"addr":4096,"length":8}]}`, "corrupted segment descriptor"},
		{"zero addr", `{"name":"h:1","protocol":"tcp","tcp_data_port":1,"buffers":[{"name":"h:1","addr":0,"length":8}]}`, "corrupted segment descriptor"},
		{"zero length", `{"name":"h:1","protocol":"tcp","tcp_data_port":1,"buffers":[{"name":"h:1","addr":4096,"length":0}]}`, "corrupted segment descriptor"},
		{"multi-protocol tcp buffer zero addr", `{"name":"h:1","protocol":["tcp","hip"],"buffers":[{"name":"h:1","addr":0,"length":8,"protocol":"tcp"}]}`, "corrupted segment descriptor"},
		{"addr 2^64", `{"name":"h:1","protocol":"tcp","buffers":[{"name":"h:1","addr":18446744073709551616,"length":8}]}`, "addr"},
		{"negative length", `{"name":"h:1","protocol":"tcp","buffers":[{"name":"h:1","addr":4096,"length":-8}]}`, "length"},
		{"fractional addr", `{"name":"h:1","protocol":"tcp","buffers":[{"name":"h:1","addr":4096.5,"length":8}]}`, "addr"},
		{"exponent addr", `{"name":"h:1","protocol":"tcp","buffers":[{"name":"h:1","addr":1e5,"length":8}]}`, "addr"},
		{"string addr", `{"name":"h:1","protocol":"tcp","buffers":[{"name":"h:1","addr":"4096","length":8}]}`, "addr"},
		{"port out of range", `{"name":"h:1","protocol":"tcp","tcp_data_port":65536}`, "tcp_data_port"},
		{"no protocol", `{"name":"h:1","tcp_data_port":1}`, "protocol"},
		{"protocol number", `{"name":"h:1","protocol":7}`, "protocol"},
		{"bad version", `{"name":"h:1","protocol":"tcp","tcp_proto_version":"2"}`, "tcp_proto_version"},
		{"not an object", `[1,2]`, "segment descriptor"},
		{"null", `null`, "not a JSON object"},
		{"trailing data", `{"protocol":"tcp"} {}`, "after the JSON object"},
		{"truncated", `{"protocol":"tcp"`, "segment descriptor"},
		{"empty", ``, "segment descriptor"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodeDescriptor([]byte(tt.json))
			if err == nil || !strings.Contains(err.Error(), tt.errHas) {
				t.Fatalf("err = %v, want one containing %q", err, tt.errHas)
			}
		})
	}
}

func TestEncodeJSONMatchesReference(t *testing.T) {
	d := Descriptor{
		Name: "127.0.0.1:16654", Protocols: []string{"tcp"}, TCPDataPort: 16004, TCPProtoVersion: 2,
		Buffers: []Buffer{{Name: "127.0.0.1:16654", Addr: 140398412431360, Length: 67108864}},
	}
	ts := time.Date(2026, 11, 29, 19, 37, 35, 580114000, time.Local)
	if got := string(d.encodeJSON(ts)); got != refObserved9 {
		t.Fatalf("encodeJSON =\n%s\nwant (reference §9)\n%s", got, refObserved9)
	}
	// A v1 descriptor has no tcp_proto_version, as Mooncake <= v0.3.11.
	d.TCPProtoVersion = 1
	v1 := string(d.EncodeJSON())
	if strings.Contains(v1, "tcp_proto_version") || !strings.Contains(v1, `"timestamp":"`) || !strings.HasSuffix(v1, "}\n") {
		t.Fatalf("v1 EncodeJSON = %s", v1)
	}
	back, err := DecodeDescriptor([]byte(v1))
	if err != nil || !reflect.DeepEqual(back, d) {
		t.Fatalf("round trip = %+v, %v", back, err)
	}
}

func TestContains(t *testing.T) {
	d := Descriptor{Buffers: []Buffer{
		{Name: "a", Addr: 0x1000, Length: 0x100},
		{Name: "b", Addr: 0x1100, Length: 0x100}, // adjacent to a
		{Name: "c", Addr: 1<<64 - 0x10, Length: 0x10},
	}}
	tests := []struct {
		addr, size uint64
		want       bool
	}{
		{0x1000, 0x100, true},                // all of a
		{0x1000, 1, true},                    // first byte
		{0x10ff, 1, true},                    // last byte of a
		{0x10ff, 2, false},                   // spans a and b: not inside ONE buffer
		{0x1080, 0x100, false},               // the same
		{0x1100, 0x100, true},                // all of b
		{0x1100, 0x101, false},               // past b
		{0x0fff, 2, false},                   // before a
		{0x1000, 0, false},                   // size 0
		{0, 0x10, false},                     // nowhere
		{1<<64 - 0x10, 0x10, false},          // end is 2^64: overflows u64
		{1<<64 - 0x10, 0x0f, true},           // inside c
		{1<<64 - 1, 2, false},                // wraps
		{0x1001, 1<<64 - 1, false},           // wraps
		{1<<64 - 0x10, 1<<64 - 1, false},     // wraps
		{0x1000 + 0x80, 0x80, true},          // tail of a
		{0x1000 + 0x80, 1<<64 - 0x80, false}, // wraps to exactly 0x1000+0x80-0x80
	}
	for _, tt := range tests {
		if got := d.Contains(tt.addr, tt.size); got != tt.want {
			t.Errorf("Contains(%#x, %#x) = %t, want %t", tt.addr, tt.size, got, tt.want)
		}
	}
}

func TestHasTCP(t *testing.T) {
	for _, tt := range []struct {
		p    []string
		want bool
	}{{[]string{"tcp"}, true}, {[]string{"rdma", "tcp"}, true}, {[]string{"rdma"}, false}, {nil, false}} {
		if got := (Descriptor{Protocols: tt.p}).HasTCP(); got != tt.want {
			t.Errorf("HasTCP(%q) = %t", tt.p, got)
		}
	}
}

func TestParseSessionID(t *testing.T) {
	tests := []struct {
		in   string
		host string
		port int
		ok   bool
	}{
		{"10.0.0.2:15321", "10.0.0.2", 15321, true},
		{"[::1]:15001", "::1", 15001, true},
		{"[fe80::1%eth0]:17000", "fe80::1%eth0", 17000, true},
		{"encoder-0.svc:16000", "encoder-0.svc", 16000, true},
		{"::1:15001", "", 0, false}, // IPv6 must be bracketed
		{"10.0.0.2", "", 0, false},
		{":15001", "", 0, false},
		{"h:0", "", 0, false},
		{"h:65536", "", 0, false},
		{"h:http", "", 0, false},
		{"", "", 0, false},
	}
	for _, tt := range tests {
		h, p, err := ParseSessionID(tt.in)
		if (err == nil) != tt.ok || h != tt.host || p != tt.port {
			t.Errorf("ParseSessionID(%q) = %q, %d, %v", tt.in, h, p, err)
		}
	}
}

func TestRangeErrorMessage(t *testing.T) {
	e := &RangeError{Session: "10.0.0.2:15321", Addr: 0x1000, Size: 16}
	if got, want := e.Error(), "range [0x1000,0x1010) of 16 bytes is not inside one buffer of session 10.0.0.2:15321"; got != want {
		t.Fatalf("%q\nwant %q", got, want)
	}
	w := &RangeError{Session: "s:1", Addr: 1<<64 - 1, Size: 2}
	if got := w.Error(); !strings.Contains(got, "2^64+0x1") {
		t.Fatalf("wrapping range message %q", got)
	}
	r := &RejectedError{Session: "s:1", Addr: 0x1000, Size: 16}
	if got := r.Error(); !strings.Contains(got, "ADDR_REJECTED") || !strings.Contains(got, "[0x1000,0x1010)") {
		t.Fatalf("RejectedError message %q", got)
	}
}
