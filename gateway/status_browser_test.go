package gateway

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/clock"
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

// A person opening the status page in a real (headless) browser signs in
// through its form (a wrong token does not sign in; the session cookie is
// HttpOnly and SameSite=Strict), then sees the version, each encoder by
// name with its rates and p99, the open breaker shown as open, and the
// suppression counter /metrics has; after more traffic the rates move; the
// page loads nothing from elsewhere; signing out shows the form again. The
// gateway runs on a fake clock, so the rates are exact. With
// ENCGATE_STATUS_SCREENSHOT=FILE it also saves a screenshot of the page
// there (bench/results/status-page.png is one).
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
	const token = "browser-admin-token-0123456789"
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	g := startGatewayDeps(t, fakeURLs(encs), func(c *Config) {
		c.Breaker.ConsecutiveFailures = 1
		c.Affinity.UnknownWait = 0
		c.Admin.Token = token
	}, zap.NewNop(), clk)
	clk.Advance(10 * time.Second) // the rates' window: 10 s since start
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
		chromedp.NoSandbox, chromedp.DisableGPU, chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1600, 1000))
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
	do := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		run(what, func() error { return chromedp.Do(ctx, steps...) })
	}
	text := func(what, sel string) (s string) {
		t.Helper()
		run(what, func() (err error) { s, err = chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel))); return err })
		return strings.TrimSpace(s)
	}
	cookies := func() (out []*network.Cookie) {
		t.Helper()
		run("the cookies", func() (err error) {
			out, err = chromedp.Run(ctx, func(ctx context.Context, tg *chromedp.Target) ([]*network.Cookie, error) {
				res, err := cdp.Call(ctx, tg, network.GetCookies, network.GetCookiesParams{URLs: []string{g.admin + "/"}})
				return res.Cookies, err
			})
			return err
		})
		return out
	}

	// Not signed in: the form. A wrong token shows it again, with an error,
	// and sets no cookie.
	do("navigate", chromedp.Navigate(g.admin+"/"), chromedp.WaitVisible(chromedp.CSS("#signin")))
	do("a wrong token", chromedp.SendKeys(chromedp.CSS("#token"), "wrong-admin-token-0123456789"),
		chromedp.Click(chromedp.CSS(`#signin button[type=submit]`)), chromedp.WaitVisible(chromedp.CSS("#signin-error")))
	if c := cookies(); len(c) != 0 {
		t.Errorf("a wrong token set cookies: %+v", c)
	}
	do("the token", chromedp.SendKeys(chromedp.CSS("#token"), token),
		chromedp.Click(chromedp.CSS(`#signin button[type=submit]`)), chromedp.WaitVisible(chromedp.CSS("#encoders")))
	jar := cookies()
	if len(jar) != 1 || !jar[0].HTTPOnly || jar[0].SameSite != network.CookieSameSiteStrict || jar[0].Path != "/" ||
		!strings.HasPrefix(jar[0].Name, "encgate_admin_") || strings.Contains(jar[0].Value, token) {
		for _, c := range jar {
			t.Logf("cookie %+v", *c)
		}
		t.Fatalf("after signing in: %d cookies, want one HttpOnly, SameSite=Strict session cookie", len(jar))
	}

	var names []string
	var title string
	var shot []byte
	run("title", func() (err error) { title, err = chromedp.Run(ctx, chromedp.Title()); return err })
	run("encoder names", func() (err error) {
		names, err = chromedp.Run(ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#encoders tr[data-encoder] td:first-child")].map(td => td.innerText)`))
		return err
	})
	breaker2 := text("enc-2's breaker", `tr[data-encoder="enc-2"] .breaker`)
	dupText := text("the suppression table", `table[data-metric="encgate_send_duplicates_suppressed_total"]`)
	version := text("the version", "#version")
	rps0 := text("enc-0's rate", `tr[data-encoder="enc-0"] td.rps`)
	p99 := text("enc-0's p99", `tr[data-encoder="enc-0"] td.p99`)
	dupRate := text("the suppression rate", `#dups tr[data-dup="replay"] td.num`)
	var resources []string
	run("the resources loaded", func() (err error) {
		resources, err = chromedp.Run(ctx, chromedp.Evaluate[[]string](`performance.getEntriesByType("resource").map(e => e.name)`))
		return err
	})
	run("screenshot", func() (err error) { shot, err = chromedp.Run(ctx, chromedp.FullScreenshot(100)); return err })
	if title != "encgate status" {
		t.Errorf("title %q", title)
	}
	if strings.Join(names, ",") != "enc-0,enc-1,enc-2" {
		t.Errorf("encoders seen: %v, want enc-0, enc-1, enc-2", names)
	}
	if breaker2 != "open" {
		t.Errorf("enc-2's breaker reads %q, want open", breaker2)
	}
	if version != buildVersion("") {
		t.Errorf("the version reads %q, want %q", version, buildVersion(""))
	}
	// enc-0 took 3 /encodes and 3 /sends (the duplicates suppressed) in
	// 10 s; the fake clock stood still through each.
	if rps0 != "0.6/s" || p99 != "990µs" {
		t.Errorf("enc-0 reads %s, p99 %s; want 0.6/s, p99 990µs", rps0, p99)
	}
	if dupRate != "0.6/s" {
		t.Errorf("duplicates suppressed (replay) read %q, want 0.6/s (6 in 10 s)", dupRate)
	}
	if len(resources) != 0 {
		t.Errorf("the page loaded %v", resources)
	}
	// What the page shows is what /metrics has.
	m := doWith(t, "GET", g.admin+"/metrics", "", nil).body
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

	// More traffic 10 s later: 14 /encodes more on enc-0 in 20 s is 1/s.
	clk.Advance(10 * time.Second)
	for i := 0; i < 14; i++ {
		id := ownedBy(t, g, "enc-0", "more-"+string(rune('a'+i)))
		if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
			t.Fatalf("/encode %s: %d %s", id, a.status, a.body)
		}
	}
	do("reload", chromedp.Reload(), chromedp.WaitVisible(chromedp.CSS("#encoders")))
	if got := text("enc-0's rate after traffic", `tr[data-encoder="enc-0"] td.rps`); got != "1/s" {
		t.Errorf("enc-0 after 14 more /encodes reads %q, want 1/s (was %s)", got, rps0)
	}

	// Signing out shows the form again and deletes the cookie.
	do("sign out", chromedp.Click(chromedp.CSS(`#signout button[type=submit]`)), chromedp.WaitVisible(chromedp.CSS("#signin")))
	if c := cookies(); len(c) != 0 {
		t.Errorf("after signing out: cookies %+v", c)
	}
	if out := os.Getenv("ENCGATE_STATUS_SCREENSHOT"); out != "" {
		if err := os.WriteFile(out, shot, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
