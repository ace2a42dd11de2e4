package deploy

// Checks of the Prometheus Operator add-on in kubernetes/prometheus-operator:
// its manifests decode strictly, its ServiceMonitors reach the gateway's and
// the agents' admin listeners (the ports the ConfigMaps' configs bind,
// through Services of the add-on only), and its PrometheusRule holds
// exactly the groups of prometheus/alerts.yaml, so the two cannot drift.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"testing"

	"go.yaml.in/yaml/v3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sigsyaml "sigs.k8s.io/yaml"
)

const (
	// kubeOperatorDir is the add-on, relative to this package.
	kubeOperatorDir = kubeDir + "/prometheus-operator"
	// kubeOperatorRule is its generated PrometheusRule.
	kubeOperatorRule = "prometheusrule.yaml"
	// kubeOperatorRegenerate regenerates it from alertsFile.
	kubeOperatorRegenerate = "go run ./deploy/promop"
)

// kubeServiceMonitor is the part of monitoring.coreos.com/v1 ServiceMonitor
// the add-on writes; any other field fails the strict decode.
type kubeServiceMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector          metav1.LabelSelector `json:"selector"`
		NamespaceSelector *struct {
			Any        bool     `json:"any,omitempty"`
			MatchNames []string `json:"matchNames,omitempty"`
		} `json:"namespaceSelector,omitempty"`
		Endpoints []struct {
			Port     string `json:"port"`
			Path     string `json:"path"`
			Scheme   string `json:"scheme"`
			Interval string `json:"interval"`
		} `json:"endpoints"`
	} `json:"spec"`
}

// kubePrometheusRule is monitoring.coreos.com/v1 PrometheusRule, with the
// rule fields the operator's CRD defines: a key of alerts.yaml that the
// CRD does not know fails the strict decode.
type kubePrometheusRule struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Groups []struct {
			Name     string `json:"name"`
			Interval string `json:"interval,omitempty"`
			Limit    *int   `json:"limit,omitempty"`
			Rules    []struct {
				Alert         string            `json:"alert,omitempty"`
				Record        string            `json:"record,omitempty"`
				Expr          string            `json:"expr"`
				For           string            `json:"for,omitempty"`
				KeepFiringFor string            `json:"keep_firing_for,omitempty"`
				Labels        map[string]string `json:"labels,omitempty"`
				Annotations   map[string]string `json:"annotations,omitempty"`
			} `json:"rules"`
		} `json:"groups"`
	} `json:"spec"`
}

// kubeOperator is the add-on, decoded.
type kubeOperator struct {
	namespace string
	services  []*corev1.Service
	monitors  []*kubeServiceMonitor
	rules     []*kubePrometheusRule
}

// kubeOperatorLoad decodes every resource the add-on's kustomization lists:
// its own kinds into the types above, the others as the kit's are.
func kubeOperatorLoad(t *testing.T) *kubeOperator {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(kubeOperatorDir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	js, err := sigsyaml.YAMLToJSONStrict(data)
	if err != nil {
		t.Fatalf("%s/kustomization.yaml: %v", kubeOperatorDir, err)
	}
	var k kubeKustomization
	if err := kubeStrictJSON(js, &k); err != nil {
		t.Fatalf("%s/kustomization.yaml: %v", kubeOperatorDir, err)
	}
	op := &kubeOperator{namespace: k.Namespace}
	for _, res := range k.Resources {
		data, err := os.ReadFile(filepath.Join(kubeOperatorDir, res))
		if err != nil {
			t.Fatalf("%s/kustomization.yaml lists %s: %v", kubeOperatorDir, res, err)
		}
		for i, part := range kubeDocSep.Split(string(data), -1) {
			where := fmt.Sprintf("%s#%d", res, i)
			js, err := sigsyaml.YAMLToJSONStrict([]byte(part))
			if err != nil {
				t.Fatalf("%s: %v", where, err)
			}
			if t := bytes.TrimSpace(js); len(t) == 0 || string(t) == "null" {
				continue
			}
			var tm metav1.TypeMeta
			if err := json.Unmarshal(js, &tm); err != nil {
				t.Fatalf("%s: %v", where, err)
			}
			var obj any
			switch tm.Kind {
			case "ServiceMonitor":
				m := new(kubeServiceMonitor)
				op.monitors, obj = append(op.monitors, m), m
			case "PrometheusRule":
				r := new(kubePrometheusRule)
				op.rules, obj = append(op.rules, r), r
			default:
				d, err := kubeDecodeDoc([]byte(part))
				if err != nil {
					t.Fatalf("%s: %v", where, err)
				}
				s, ok := d.obj.(*corev1.Service)
				if !ok {
					t.Fatalf("%s: a %s: the add-on holds Services, ServiceMonitors and PrometheusRules", where, d.kind)
				}
				op.services = append(op.services, s)
				continue
			}
			if tm.APIVersion != "monitoring.coreos.com/v1" {
				t.Fatalf("%s: %s has apiVersion %q, want monitoring.coreos.com/v1", where, tm.Kind, tm.APIVersion)
			}
			if err := kubeStrictJSON(js, obj); err != nil {
				t.Fatalf("%s: %s: %v", where, tm.Kind, err)
			}
			if obj.(metav1.Object).GetName() == "" {
				t.Fatalf("%s: %s has no metadata.name", where, tm.Kind)
			}
		}
	}
	return op
}

// TestKubeOperatorKustomization: the add-on's kustomization lists each of
// its files and nothing outside its directory (kustomize refuses the kit as
// a base of a directory inside it), in the kit's namespace; and it renders
// with kubectl's kustomize where kubectl is installed.
func TestKubeOperatorKustomization(t *testing.T) {
	kit := kubeLoad(t)
	op := kubeOperatorLoad(t)
	if op.namespace != kit.namespace {
		t.Errorf("%s's namespace %q, the kit's %q: the ServiceMonitors find Services of their own namespace", kubeOperatorDir, op.namespace, kit.namespace)
	}
	data, _ := os.ReadFile(filepath.Join(kubeOperatorDir, "kustomization.yaml"))
	var k struct {
		Resources []string `json:"resources"`
	}
	if err := sigsyaml.Unmarshal(data, &k); err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(kubeOperatorDir)
	if err != nil {
		t.Fatal(err)
	}
	var files []string
	for _, e := range entries {
		if e.Name() != "kustomization.yaml" {
			files = append(files, e.Name())
		}
	}
	listed := slices.Sorted(slices.Values(k.Resources))
	if !slices.Equal(listed, files) {
		t.Errorf("%s/kustomization.yaml lists %v, the directory holds %v", kubeOperatorDir, listed, files)
	}
	if len(op.monitors) == 0 || len(op.rules) != 1 {
		t.Errorf("the add-on holds %d ServiceMonitors and %d PrometheusRules, want some and one", len(op.monitors), len(op.rules))
	}

	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Log("kubectl is not installed: the add-on is not rendered")
		return
	}
	var stderr bytes.Buffer
	cmd := exec.Command(kubectl, "kustomize", kubeOperatorDir)
	cmd.Stderr = &stderr
	if out, err := cmd.Output(); err != nil {
		t.Errorf("kubectl kustomize %s: %v\n%s", kubeOperatorDir, err, stderr.String())
	} else if n := len(kubeDocSep.Split(string(out), -1)); n != len(op.services)+len(op.monitors)+len(op.rules) {
		t.Errorf("kubectl kustomize %s renders %d objects, the files hold %d", kubeOperatorDir, n, len(op.services)+len(op.monitors)+len(op.rules))
	}
}

// TestKubeOperatorMonitorsScrapeTheAdminPorts: for the gateway and the
// agent, exactly one ServiceMonitor reaches their pods, through exactly one
// Service, which is the add-on's (the kit's own Services are not scraped):
// its port is the one the endpoint names and targets the container port
// the config's admin_listen binds, which the workload's NetworkPolicy
// opens (to the scrapers); the path is /metrics over plain HTTP.
func TestKubeOperatorMonitorsScrapeTheAdminPorts(t *testing.T) {
	kit := kubeLoad(t)
	op := kubeOperatorLoad(t)
	seen := map[string]bool{}
	for _, e := range kit.encgateContainers() {
		if !kubeRunsSubcommand(e.c) {
			continue
		}
		sub := e.c.Args[0]
		seen[sub] = true
		got, err := kubeParseArgs(e.c.Args[1:], map[string]bool{"config": true, "check": false})
		if err != nil || len(got["config"]) != 1 {
			t.Fatalf("%s: args %q: %v", e, e.c.Args, err)
		}
		content, err := kit.configMapFile(&e.w.pod.Spec, e.c, got["config"][0])
		if err != nil {
			t.Fatal(err)
		}
		_, cfg := kit.localConfig(t, e, content, nil)
		_, adminPort := kubePort(t, kubeAddrsOf(sub, cfg).admin)

		var reach []string
		for _, m := range op.monitors {
			for _, s := range kit.services {
				if kubeSelects(t, &m.Spec.Selector, s.Labels) {
					t.Errorf("ServiceMonitor %s selects the kit's Service %s, which serves no /metrics", m.Name, s.Name)
				}
			}
			if ns := m.Spec.NamespaceSelector; ns != nil && (ns.Any || !slices.Equal(ns.MatchNames, []string{op.namespace})) {
				t.Errorf("ServiceMonitor %s looks for Services beyond its own namespace: %+v", m.Name, *ns)
			}
			for _, s := range op.services {
				if !kubeSelects(t, &m.Spec.Selector, s.Labels) || !kubeSubset(s.Spec.Selector, e.w.pod.Labels) {
					continue
				}
				reach = append(reach, m.Name+" through "+s.Name)
				if len(m.Spec.Endpoints) == 0 {
					t.Errorf("ServiceMonitor %s has no endpoint", m.Name)
				}
				for _, ep := range m.Spec.Endpoints {
					i := slices.IndexFunc(s.Spec.Ports, func(p corev1.ServicePort) bool { return p.Name == ep.Port })
					if i < 0 {
						t.Errorf("ServiceMonitor %s: port %q is no port of Service %s", m.Name, ep.Port, s.Name)
						continue
					}
					target := s.Spec.Ports[i].TargetPort
					cp := slices.IndexFunc(e.c.Ports, func(p corev1.ContainerPort) bool {
						return p.Name == target.String() || strconv.Itoa(int(p.ContainerPort)) == target.String()
					})
					switch {
					case cp < 0:
						t.Errorf("Service %s port %s targets %s, no port of %s", s.Name, ep.Port, target.String(), e)
					case e.c.Ports[cp].ContainerPort != adminPort:
						t.Errorf("Service %s port %s reaches %s's port %d, but admin_listen (where /metrics is) binds %d", s.Name, ep.Port, e, e.c.Ports[cp].ContainerPort, adminPort)
					default:
						for _, np := range kit.netpols {
							if kubeSelects(t, &np.Spec.PodSelector, e.w.pod.Labels) && !kubeOpens(np, e.c.Ports[cp].Name) {
								t.Errorf("NetworkPolicy %s opens %s's port %s to no scraper", np.Name, e, e.c.Ports[cp].Name)
							}
						}
					}
					if ep.Path != "/metrics" {
						t.Errorf("ServiceMonitor %s scrapes %q, want /metrics", m.Name, ep.Path)
					}
					if ep.Scheme != "" && ep.Scheme != "http" {
						t.Errorf("ServiceMonitor %s: scheme %q: the admin listener is plain HTTP", m.Name, ep.Scheme)
					}
				}
			}
		}
		if len(reach) != 1 {
			t.Errorf("%s's /metrics is reached by %q, want one ServiceMonitor through one Service", e, reach)
		}
	}
	if !seen["gateway"] || !seen["agent"] {
		t.Errorf("checked %v, want the gateway and the agent", seen)
	}
}

// TestKubeOperatorRuleIsTheAlerts: the PrometheusRule's spec.groups are
// alerts.yaml's groups, value for value, so the operator's cluster runs
// the rules promtool and alerts_test.yaml check.
func TestKubeOperatorRuleIsTheAlerts(t *testing.T) {
	op := kubeOperatorLoad(t)
	if len(op.rules) != 1 {
		t.Fatalf("the add-on holds %d PrometheusRules, want 1 (%s)", len(op.rules), kubeOperatorRule)
	}
	var alerts map[string]any
	raw, err := os.ReadFile(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, &alerts); err != nil {
		t.Fatal(err)
	}
	var rule struct {
		Spec map[string]any `yaml:"spec"`
	}
	raw, err = os.ReadFile(filepath.Join(kubeOperatorDir, kubeOperatorRule))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, &rule); err != nil {
		t.Fatal(err)
	}
	if alerts["groups"] == nil {
		t.Fatalf("%s has no groups", alertsFile)
	}
	if !reflect.DeepEqual(rule.Spec["groups"], alerts["groups"]) {
		t.Errorf("%s/%s's spec.groups are not %s's groups: run %s", kubeOperatorDir, kubeOperatorRule, alertsFile, kubeOperatorRegenerate)
	}
	for k := range rule.Spec {
		if k != "groups" {
			t.Errorf("%s/%s's spec has %s, which alerts.yaml does not give", kubeOperatorDir, kubeOperatorRule, k)
		}
	}
}
