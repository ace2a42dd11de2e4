package gateway

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/testtool"
)

// browserPath finds a Chromium the test can drive, or "".
func browserPath() string {
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	return ""
}

// A person opening the status page in a real (headless) browser sees each
// encoder by name, the open breaker shown as open, and the suppression
// counter /metrics has. With ENCGATE_STATUS_SCREENSHOT=FILE it also saves
// a screenshot of the page there (bench/results/status-page.png is one).
func TestStatusPageInABrowser(t *testing.T) {
	browser := browserPath()
	if browser == "" {
		testtool.Missing(t, "chromium", "chromium", "the status page is not checked in a browser")
	}
	encs := startFakes(t, 3, func(i int, o *fakeencoder.Options) {
		if i == 2 {
			o.Faults = fakeencoder.Faults{FailureRate: 1, FailRoutes: []string{"/encode"}}
		}
	})
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Breaker.ConsecutiveFailures = 1
		c.Affinity.UnknownWait = 0
	})
	bad := ownedBy(t, g, "enc-2", "broken")
	if a := post(t, g.base+"/encode", encodeBody(bad)); a.status == 200 {
		t.Fatalf("/encode on the failing encoder: %d", a.status)
	}
	for i := 0; i < 6; i++ {
		id := ownedBy(t, g, "enc-"+string(rune('0'+i%2)), "ok-"+string(rune('a'+i)))
		if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
			t.Fatalf("/encode %s: %d %s", id, a.status, a.body)
		}
		for k := 0; k < 2; k++ { // the second is a duplicate
			if a := post(t, g.base+"/send", sendBody(id, 40000)); a.status != 200 {
				t.Fatalf("/send: %d %s", a.status, a.body)
			}
		}
	}
	if a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(bad)); a.status == 200 {
		t.Fatalf("follow-up of a failed /encode: %d", a.status)
	}

	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(browser),
		chromedp.NoSandbox, chromedp.DisableGPU, chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1400, 1000))
	actx, cancelA := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancelA()
	ctx, cancel := chromedp.NewContext(actx)
	defer cancel()
	ctx, cancelT := context.WithTimeout(ctx, 60*time.Second)
	defer cancelT()

	run := func(what string, f func() error) {
		t.Helper()
		if err := f(); err != nil {
			t.Fatalf("%s in %s: %v", what, browser, err)
		}
	}
	var names []string
	var breaker2, dupText, title string
	var shot []byte
	run("navigate", func() error { _, err := chromedp.Run(ctx, chromedp.Navigate(g.admin+"/")); return err })
	run("wait for the encoders", func() error { _, err := chromedp.Run(ctx, chromedp.WaitVisible(chromedp.CSS("#encoders"))); return err })
	run("title", func() (err error) { title, err = chromedp.Run(ctx, chromedp.Title()); return err })
	run("encoder names", func() (err error) {
		names, err = chromedp.Run(ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#encoders tr[data-encoder] td:first-child")].map(td => td.innerText)`))
		return err
	})
	run("enc-2's breaker", func() (err error) {
		breaker2, err = chromedp.Run(ctx, chromedp.Text(chromedp.CSS(`tr[data-encoder="enc-2"] .breaker`)))
		return err
	})
	run("the suppression table", func() (err error) {
		dupText, err = chromedp.Run(ctx, chromedp.Text(chromedp.CSS(`table[data-metric="encgate_send_duplicates_suppressed_total"]`)))
		return err
	})
	run("screenshot", func() (err error) { shot, err = chromedp.Run(ctx, chromedp.FullScreenshot(100)); return err })
	if title != "encgate status" {
		t.Errorf("title %q", title)
	}
	if strings.Join(names, ",") != "enc-0,enc-1,enc-2" {
		t.Errorf("encoders seen: %v, want enc-0, enc-1, enc-2", names)
	}
	if strings.TrimSpace(breaker2) != "open" {
		t.Errorf("enc-2's breaker reads %q, want open", breaker2)
	}
	// What the page shows is what /metrics has.
	m := do(t, "GET", g.admin+"/metrics", "").body
	for _, l := range strings.Split(m, "\n") {
		if !strings.HasPrefix(l, "encgate_send_duplicates_suppressed_total{") {
			continue
		}
		value := l[strings.LastIndex(l, " ")+1:]
		labels := strings.NewReplacer(`"`, "", ",", ", ").Replace(l[strings.Index(l, "{")+1 : strings.Index(l, "}")])
		if value != "0" && !strings.Contains(dupText, labels+"\t"+value) {
			t.Errorf("the page's suppression table %q lacks %s = %s from /metrics", dupText, labels, value)
		}
	}
	if !strings.Contains(m, "encgate_send_duplicates_suppressed_total{") {
		t.Error("/metrics counted no suppressed duplicate")
	}
	if out := os.Getenv("ENCGATE_STATUS_SCREENSHOT"); out != "" {
		if err := os.WriteFile(out, shot, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
