package sglang

import "testing"

func TestStripFanout(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"/p/0/encode", "/encode"},
		{"/p/3/scheduler_receive_meta_data", "/scheduler_receive_meta_data"},
		{"/p/1023/send", "/send"},
		{"/p/1024/send", "/p/1024/send"}, // k must be below 1024
		{"/p/01/send", "/p/01/send"},     // no leading zeros: one URL, one spelling
		{"/p//send", "/p//send"},
		{"/p/3", "/p/3"},
		{"/p/3/", "/"},
		{"/p/x/send", "/p/x/send"},
		{"/encode", "/encode"},
		{"/p/99999999999999999999/send", "/p/99999999999999999999/send"},
	} {
		if got := string(StripFanout([]byte(c.in))); got != c.want {
			t.Errorf("StripFanout(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}
