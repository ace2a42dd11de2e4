package mooncake

import (
	"bytes"
	"encoding/binary"
	"reflect"
	"testing"
	"time"
)

func FuzzParseHeader(f *testing.F) {
	f.Add(unhex(f, `00 10 00 00 00 00 00 00  00 50 34 12 8a 7f 00 00  01  00 00 00 00 00 00 00`))
	f.Add(unhex(f, `00 10 00 00 00 00 00 00  00 50 34 12 8a 7f 00 00  81  00 00 00 00 00 00 00`))
	f.Add(unhex(f, `08 00 00 00 00 00 00 00  00 10 00 00 00 00 00 00  81  de ad be ef 13 37 42`))
	f.Add([]byte{})
	f.Add(make([]byte, 23))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 4*HeaderSize {
			b = b[:4*HeaderSize] // longer inputs add nothing, and slow minimisation
		}
		h, err := ParseHeader(b)
		if len(b) != HeaderSize {
			if err == nil {
				t.Fatalf("%d bytes accepted", len(b))
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		enc := AppendHeader(nil, h)
		if len(enc) != HeaderSize || !bytes.Equal(enc[:17], b[:17]) || !bytes.Equal(enc[17:], make([]byte, 7)) {
			t.Fatalf("AppendHeader(ParseHeader(% x)) = % x", b, enc)
		}
		if h2, err := ParseHeader(enc); err != nil || h2 != h {
			t.Fatalf("round trip %+v -> %+v, %v", h, h2, err)
		}
	})
}

func FuzzParseStatus(f *testing.F) {
	f.Add(unhex(f, `00 00 00 00 56 54 43 4d`))
	f.Add(unhex(f, `01 00 00 00 56 54 43 4d`))
	f.Add(unhex(f, `00 00 00 00 4d 43 54 56`))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := ParseStatus(b)
		if err != nil {
			return
		}
		if enc := AppendStatus(nil, st); !bytes.Equal(enc, b) {
			t.Fatalf("AppendStatus(ParseStatus(% x)) = % x", b, enc)
		}
	})
}

func FuzzReadFrame(f *testing.F) {
	f.Add(unhex(f, goldenMetadataRequest))
	f.Add(unhex(f, goldenProbeReply))
	f.Add(unhex(f, `07 00 00 00 00 00 00 00  7b 22 61 22 3a 31 7d`))
	f.Add(unhex(f, `01 00 10 00 00 00 00 00  01`))
	f.Add(unhex(f, `00 00 00 00 00 00 00 00`))
	f.Add(unhex(f, `ff ff ff ff ff ff ff ff  01`))
	f.Add(unhex(f, `01 00 00 00 00 00 00 00  02`))
	f.Fuzz(func(t *testing.T, b []byte) {
		const limit = 4096
		if len(b) > 2*limit {
			return // keeps minimisation fast; the limit is tested by size
		}
		r := bytes.NewReader(b)
		typ, body, legacy, err := readFrame(r, limit)
		if err != nil {
			if len(b) >= 8 {
				n := binary.LittleEndian.Uint64(b)
				if n > 0 && n <= limit && uint64(len(b)-8) >= n {
					t.Fatalf("a complete frame of length %d was refused: %v", n, err)
				}
			}
			return
		}
		consumed := b[:len(b)-r.Len()]
		var out bytes.Buffer
		if legacy {
			if typ != HSConnection || len(body) == 0 || body[0] <= HSProbe {
				t.Fatalf("legacy frame decoded as type %d body % x", typ, body)
			}
			_ = writeLegacyFrame(&out, body)
		} else {
			if typ > HSProbe {
				t.Fatalf("type %d", typ)
			}
			_ = WriteFrame(&out, typ, body)
		}
		if !bytes.Equal(out.Bytes(), consumed) {
			t.Fatalf("re-encoded % x, read % x", out.Bytes(), consumed)
		}
		typ2, body2, err := ReadFrame(bytes.NewReader(consumed), limit)
		if err != nil || typ2 != typ || !bytes.Equal(body2, body) {
			t.Fatalf("ReadFrame differs from readFrame")
		}
	})
}

func FuzzDecodeDescriptor(f *testing.F) {
	f.Add([]byte(refExample23))
	f.Add([]byte(refObserved9))
	f.Add([]byte(`{"name":"h:1","protocol":["tcp","hip"],"tcp_data_port":16000,"buffers":[{"name":"h:1","addr":4096,"length":100,"protocol":"tcp"},{"name":"c","addr":1,"length":1,"protocol":"hip"}]}`))
	f.Add([]byte(`{"name":"h:1","protocol":"tcp","buffers":[{"name":"h:1","addr":18446744073709551615,"length":1}]}`))
	f.Add([]byte(`{"name":"h:1","protocol":"tcp","buffers":[{"name":"","addr":4096,"length":8}]}`))
	f.Add([]byte(`{"protocol":"tcp","tcp_proto_version":-3,"tcp_data_port":65535}`))
	f.Add([]byte(`null`))
	f.Add([]byte(`{"protocol":"rdma","buffers":[{"name":"<&>","addr":0,"length":0}]}`))
	ts := time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC)
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 4096 {
			return // keeps minimisation fast; size adds no new paths
		}
		d, err := DecodeDescriptor(b)
		if err != nil {
			return
		}
		_ = d.HasTCP()
		for _, buf := range d.Buffers {
			_ = d.Contains(buf.Addr, buf.Length)
			_ = d.Contains(buf.Addr+1, buf.Length)
		}
		if len(d.Protocols) != 1 {
			return // EncodeJSON writes the single-protocol form only
		}
		enc := d.encodeJSON(ts)
		d2, err := DecodeDescriptor(enc)
		if err != nil {
			t.Fatalf("re-decoding %s: %v", enc, err)
		}
		want := d
		if want.TCPProtoVersion < 2 {
			want.TCPProtoVersion = 1 // written only when >= 2
		}
		if len(want.Buffers) == 0 {
			want.Buffers = nil
		}
		if !reflect.DeepEqual(d2, want) {
			t.Fatalf("round trip\n got %+v\nwant %+v", d2, want)
		}
	})
}
